"""The end of every worker script that forks its ranks from one process (which imported torch
and tiercel once: an import per rank would cost minutes of CPU on a small machine): the tests
of coordination at scale and bench/scale_real.py append it to a script that defines
`rank_main(rank)` and `world` and imports os, sys and traceback."""

# rank_main(rank) in `world` forked processes; the script fails naming the ranks that raised.
FORK_RANKS = r"""
pids = []
for rank in range(world):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            rank_main(rank)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    pids.append(pid)
failed = [r for r, pid in enumerate(pids) if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
sys.exit(f"ranks {failed} failed" if failed else 0)
"""

