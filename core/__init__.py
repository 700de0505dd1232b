"""The science of tcnn, importable alone (torch, timm, numpy, pyarrow, imagecorruptions).
Never imports ray, mlflow, dvc or submitit."""
