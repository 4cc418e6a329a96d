"""``weightsync estimate``: a sync's seconds and each NIC's bytes on a cluster the user
describes, predicted from the route the real sync would take (``routes``), with this
machine's costs (``predict.Calibration``)."""

from weightsync.estimate.cluster import Cluster, Host
from weightsync.estimate.predict import Calibration, Estimate, calibrate, ceiling_s, predict
from weightsync.estimate.routes import BACKENDS, flows_of, route_of

__all__ = [
    "BACKENDS",
    "Calibration",
    "Cluster",
    "Estimate",
    "Host",
    "calibrate",
    "ceiling_s",
    "flows_of",
    "predict",
    "route_of",
]
