# The start both of main_ppo's bridge scripts share after `orphan_watch.py` (the reward bridge,
# bridge.py, and the tool bridge, tool_bridge.py, each run after them as one `python3 -u -c`
# program): the protocol's descriptors.
import os

# The protocol's descriptors stay out of processes the user's code starts. A lone surrogate in
# a reply becomes "?" rather than breaking the reply line.
os.set_inheritable(3, False)
os.set_inheritable(4, False)
_requests = os.fdopen(3, "r", encoding="utf-8")
_proto = os.fdopen(4, "w", buffering=1, encoding="utf-8", errors="replace")
