"""Other trainers' data: importing a rollout dump as a run (import_run.py; the readers: tasks/core/dumps.py) and
exporting a run's curriculum (export_run.py)."""
