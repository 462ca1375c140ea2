"""How a run is driven from outside its stages: compile, run on this machine, resume, schedule.

Design, details and limitations: docs/architecture.md#the-tree-where-each-kind-of-code-lives.
"""
