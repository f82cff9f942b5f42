# The start both of main_ppo's worker scripts share (the reward bridge, bridge.py, and the tool
# bridge, tool_bridge.py, each run after it as one `python3 -u -c` program): the protocol's
# descriptors and the watch on main_ppo itself.
import os
import signal
import threading
import time

# The protocol's descriptors stay out of processes the user's code starts. A lone surrogate in
# a reply becomes "?" rather than breaking the reply line.
os.set_inheritable(3, False)
os.set_inheritable(4, False)
_requests = os.fdopen(3, "r", encoding="utf-8")
_proto = os.fdopen(4, "w", buffering=1, encoding="utf-8", errors="replace")


def _orphaned():
    # main_ppo went away without stopping this worker (killed, or exited at once on a second
    # Ctrl-C): end the processes the user's code started, and this one. main_ppo makes each
    # worker the leader of a process group of its own.
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _watch_parent(ppid):
    # Notices main_ppo's end even while user code is stuck.
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            _orphaned()


threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
