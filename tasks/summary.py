"""Summary: when the last operation of the run has ended, one table of what the converge did on each
host (driver installed and rebooted, model bytes from the hub or a peer, image pulled, variant
(re)started, health gate passed in N s; "no change" for a converged host).

True afterwards: nothing changed (this file adds no operation; it registers the printer).
"""

from pyinfra import state

from rigup.runstate import print_summary_at_the_end

print_summary_at_the_end(state)
