"""Prefect plumbing: `refinery serve` (serve.py), the temporary API server a command starts early
(early_server.py), where Prefect keeps its home (prefect_home.py), how a command prepares Prefect
(prefect_setup.py), and children in sessions of their own (sessions.py)."""
