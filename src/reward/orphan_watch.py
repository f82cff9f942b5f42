# The start every Python worker of main_ppo shares (the reward bridge, the tool bridge, the
# tracker workers; each run as one `python3 -u -c` program with this first): a watch on
# main_ppo itself. main_ppo makes each worker the leader of a process group of its own and kills
# that group when it ends the worker; when main_ppo dies without doing so (SIGKILL, a crash),
# the watch ends the group: the worker and whatever the user's code or an SDK started.
import os
import signal
import threading
import time


def _orphaned():
    # main_ppo went away without stopping this worker (killed, or exited at once on a second
    # Ctrl-C): end the processes this one started, and this one.
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
