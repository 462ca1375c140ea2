"""How a run is driven from outside its stages: compile, run on this machine, resume, schedule.

Design, details and limitations: docs/pipelines.md#moerlorchestrate__init__py.
"""
