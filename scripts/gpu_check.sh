#!/usr/bin/env bash
# The CUDA check: the `gpu`-marked tests and the stage tests (pretrain, reparam, finetune, control, evaluate,
# import) on CUDA, then T-CNN vs CNN throughput, peak memory and the conversion's exactness
# (benchmarks/gpu_throughput.py), printed as one markdown table. Sized for about 8 minutes on one H100/H200.
#
#   scripts/gpu_check.sh --fetch-wheels   # here, once: the wheels a bare GPU image lacks (uv.lock's versions),
#                                         # into .whl/, and Fashion-MNIST into .fmnist/ (both git-excluded)
#   scripts/gpu_check.sh                  # on the GPU machine (its python3 has torch, timm, pyarrow, scipy)
#   scripts/gpu_check.sh --dry-run        # on a CPU with the project's venv: the same steps, tiny sizes (CI)
#
# The table is written to $OUT/gpu_check.md when OUT is set (else a temporary folder); exit status: pytest's
# (0 when every test passed) unless the benchmark itself fails.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions imagecorruptions-imaug submitit)
TESTS=(tests/test_gpsa.py tests/test_precision.py tests/test_import.py tests/test_stages_train.py tests/test_control.py
       tests/test_evaluate_stage.py tests/test_early_stop.py)

dry=0
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        --fetch-wheels)
            mkdir -p .whl
            grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
            for name in "${WHEELS[@]}"; do
                version=$(grep -A1 "^name = \"$name\"$" uv.lock | sed -n 's/^version = "\(.*\)"/\1/p')
                python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$name==$version" || exit 1
            done
            ls .whl
            # the tests' real data, as CI has it (tests/_train_helpers.py falls back to synthetic images)
            mkdir -p .fmnist && cp /usr/share/datasets/fashion-mnist/*.gz .fmnist/ || exit 1
            grep -qx '/.fmnist/' .git/info/exclude || echo /.fmnist/ >>.git/info/exclude
            exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (expected --dry-run or --fetch-wheels)" >&2; exit 2 ;;
    esac
done

out=${OUT:-$(mktemp -d)}
if [ "$dry" = 1 ]; then
    py=.venv/bin/python
    # On a CPU the stage tests already run in the suite: collect them only; the gpu tests skip themselves.
    test_args=(-m gpu)
    limit=()
    bench_args=(--dry-run)
else
    py=python3
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    fmnist=/usr/share/datasets/fashion-mnist
    if ls .fmnist/*.gz >/dev/null 2>&1 && [ ! -e "$fmnist" ]; then mkdir -p "$fmnist" && cp .fmnist/*.gz "$fmnist"/; fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    export TCNN_TEST_DEVICE=cuda
    test_args=(--timeout 150)
    limit=(timeout -s INT "${GPU_CHECK_TEST_S:-240}")   # SIGINT: pytest stops and still writes its report
    bench_args=()
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

start=$(date +%s)
"${limit[@]}" "$py" -m pytest -q -p no:cacheprovider -o addopts="" "${test_args[@]}" --junitxml "$out/junit.xml" "${TESTS[@]}" \
    2>&1 | tail -n 40
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" = 5 ] && tests_rc=0   # dry run: every test deselected or skipped is the expected outcome
echo "tests: exit $tests_rc in $(( $(date +%s) - start )) s"

"$py" benchmarks/gpu_throughput.py "${bench_args[@]}" --junit "$out/junit.xml" --out "$out/gpu_check.md" || exit 1
echo "gpu_check: $(( $(date +%s) - start )) s in all; table in $out/gpu_check.md"
exit "$tests_rc"
