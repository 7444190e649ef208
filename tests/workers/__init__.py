"""The programs that multi-process tests launch, one per test module, named after it; see
tests/README.md for which test runs which worker, with which modes, launcher and marker."""
