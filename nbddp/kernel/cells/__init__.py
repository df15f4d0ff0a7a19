"""A cell's run: the one engine, the rules of each kind of cell, failures, prompts, background cells."""
