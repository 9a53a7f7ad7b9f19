"""A run's report: the folder with index.html (page.py), its numbers and plots (plots.py), and progress on long
work (progress.py). The report stage is tasks/report.py."""
