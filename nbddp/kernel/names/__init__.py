"""The notebook's names: values sent to ranks, values back, %ddp who/diff, the session's cells."""
