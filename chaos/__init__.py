"""The fault campaign (`rollout chaos`): a local fleet (fleet.py), the faults it injects
(faults.py, fault_proxy.py), a trainer that keeps a ledger of what it trained (trainer.py,
ledger.py), and the proof that nothing was lost or trained twice (campaign.py, report.py)."""
