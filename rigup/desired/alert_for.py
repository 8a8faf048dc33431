"""rigup's alerts that wait before they fire, and how long (the default of the alert_for_s knob). Data
alone, below the knobs that check alert_for_s and the monitoring that renders the rules."""

# How long each alert's condition must hold before it fires (Prometheus' `for:`), in seconds, unless
# the fleet's alert_for_s says otherwise. Event-like causes (a failed gate, a crash loop, an XID) have
# none: they fire at the first evaluation. RigupReleaseDrift's 15 min outlasts a converge's own
# drift (its release file is written before the restart and the health gate); RigupGpuAtPowerCap's is
# what "sustained" means for an info alert. RigupPodOutvoted's 60 s is two sentinel rounds in a row at
# the default sentinel_interval_s (30 s) in which the pod's greedy answer is its replicas' minority.
# RigupPodLengthFinishSurge's 5 min: a surge that lasts, not one client's batch of long answers.
# RigupPodDegenerateAnswers' 2 min: the text itself is judged, so less waiting than the surge alone needs.
ALERT_FOR_S = {
    "RigupPodDown": 60, "RigupKvCacheFull": 300, "RigupTtftHigh": 600, "RigupGpuHot": 300, "RigupGpuThrottled": 300,
    "RigupGpuAtPowerCap": 900, "RigupExporterDown": 300, "RigupModelDiskFull": 300, "RigupDriverDrift": 900,
    "RigupReleaseDrift": 900, "RigupGatewayDown": 120, "RigupGatewayRouteUnhealthy": 60,
    "RigupPodOutvoted": 60, "RigupSpecDecodeAcceptanceCollapsed": 300, "RigupPodLengthFinishSurge": 300,
    "RigupPodDegenerateAnswers": 120,
}
