"""The tutorials run under nbval; the Ray one only where Ray is installed (the optional extra nbddp[ray])."""
import importlib.util

collect_ignore = [] if importlib.util.find_spec("ray") else ["10-ray-cluster.ipynb"]
