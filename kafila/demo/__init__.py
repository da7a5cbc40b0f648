"""The one-machine process harness behind `kafila demo` and the session benchmarks."""
