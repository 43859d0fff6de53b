"""Stages defined by tests, outside relay's package: a run names one by its declaration's import
string (`stage: plugin_stages.toy_stage:TOY`, with tests/ on PYTHONPATH)."""
