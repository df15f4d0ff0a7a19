"""JupyterLab's debugger panel in the ranks, the kernel's side."""
