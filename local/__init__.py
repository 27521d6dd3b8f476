"""Clusters on one machine, started by the CLI: child processes (processes.py, router.py),
`rollout demo` (demo.py; with a real model, grpo_run.py, grpo.py and case_task.py),
`rollout up` (stack.py), and the demo's dataset (data/)."""
