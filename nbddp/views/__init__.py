"""What the user sees: the relay of rank output into the cell, the cell's dashboard, the pool's dashboard,
the sampling behind them, and which view a session gets. Imports only the wire, the IPython helpers and
the hardware seams."""
