"""Study designs and their results (`tcnn study`)."""
