"""Test utilities: runs in the test's own process, training-run helpers, tensor trackers, server processes, the
GPU check as a command, and recorded fixtures."""
