"""Running methods over prompt sets: the run identity and its runner, prompt data, sweeps, self-checks and speed
benchmarks."""
