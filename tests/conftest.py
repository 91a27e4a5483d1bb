import sys
from pathlib import Path

# tests import their shared helpers (synthetic graphs) by plain module name
sys.path.insert(0, str(Path(__file__).parent))
