"""Recipes: paired real vs emulated runs validating step time, peak memory and loss (the fidelity harness).

schema (the recipe dataclasses), load (YAML), programs (command lines per framework), probe (the in-process
metrics of every run), runner (runs them), compare (pure errors and verdicts), report (table, plots,
Markdown), cli (``prism recipe``). See recipes/README.md.
"""
