"""IPython helpers used on both sides: the session, cell code as IPython compiles it, tracebacks that
read as a notebook's."""
