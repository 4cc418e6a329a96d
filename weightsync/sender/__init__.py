"""The send side: ``Sender`` (membership, warm-up, one path per engine family), the packer
that fills buckets from a source, the trainer ranks of a session where every rank sends,
and what trainer rank 0 reads from its receivers.
"""

from weightsync.sender.packer import Packer, carriable, producer
from weightsync.sender.ranks import TrainerFollower, TrainerPeers
from weightsync.sender.replies import answers, dead_ranks, explain, gather_done, lost_receivers
from weightsync.sender.sender import Sender

__all__ = [
    "Packer",
    "Sender",
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
