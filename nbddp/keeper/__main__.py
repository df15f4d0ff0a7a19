"""``python -m nbddp.keeper``: keeper/keeper.py's ``main``."""
from .keeper import main

main()
