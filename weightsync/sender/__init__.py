"""The send side: ``Sender`` (what a sync does, one path per engine family), its peers
and handshakes, its stages (``send_stages``: the route, a dense plan or a sharded one, then
the forms and delta stages), the packer that fills
buckets from a source, the trainer ranks of a session where every rank sends, and what
trainer rank 0 reads from its receivers.
"""

from weightsync.sender.packer import Packer, producer
from weightsync.sender.peers import SessionPeers
from weightsync.sender.ranks import TrainerFollower, TrainerPeers
from weightsync.sender.replies import answers, dead_ranks, explain, gather_done, lost_receivers
from weightsync.sender.route_stage import DenseSend, carriable
from weightsync.sender.sender import Sender
from weightsync.sender.sharded_route import ShardedSend
from weightsync.sender.stages import send_stages

__all__ = [
    "DenseSend",
    "Packer",
    "Sender",
    "SessionPeers",
    "ShardedSend",
    "TrainerFollower",
    "TrainerPeers",
    "answers",
    "carriable",
    "dead_ranks",
    "explain",
    "gather_done",
    "lost_receivers",
    "producer",
    "send_stages",
]
