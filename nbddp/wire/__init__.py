"""The wire between kernel and rank, imported by both sides: the messages, their framing, the output
order budget, and how values are pickled to travel. Imports nothing else of nbddp but errors."""
