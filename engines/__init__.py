"""Engines that answer like SGLang's HTTP server: the shared HTTP layer (server.py) and
request schema (generate_request.py), the engine core (core.py), and its backends (the
simulator, and the torch engine over a real model). The workers talk to these exactly as
to SGLang; nothing in the queue's core imports them."""
