"""Test doubles for FedUQ's own test suite (never named by a committed job): site executors that inject the faults a
real federation has (:mod:`feduq.testing.faults`). They live in the package so that a job naming them passes FedUQ's
job check, which imports and constructs nothing outside ``feduq``."""
