"""Helpers the tests share: servers, fixtures, workloads, verifiers and subprocess workers."""
