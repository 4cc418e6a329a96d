"""The send side: ``Sender`` (what a sync does, one path per engine family), its peers
and handshakes, its route stage (the dense plan, or a sharded route), the packer that fills
buckets from a source, the trainer ranks of a session where every rank sends, and what
trainer rank 0 reads from its receivers.
"""

from weightsync.sender.packer import Packer, producer
from weightsync.sender.peers import SessionPeers
from weightsync.sender.ranks import TrainerFollower, TrainerPeers
from weightsync.sender.replies import answers, dead_ranks, explain, gather_done, lost_receivers
from weightsync.sender.route_stage import DenseSend, Members, SendRoute, carriable
from weightsync.sender.sender import Sender
from weightsync.sender.sharded_route import ShardedSend

__all__ = [
    "DenseSend",
    "Members",
    "Packer",
    "SendRoute",
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
]
