"""Operator tools over the queue's state: status and its rendering, inspect, the
conservation audit, dead letters, admin (namespaces) and ACL roles."""
