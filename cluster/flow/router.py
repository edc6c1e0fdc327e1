"""Picks a (prefill, decode) pair per request from the live membership.

Policies see each worker's last health report (queue depth, free blocks) plus the
router's own count of requests it sent there and has not seen finish, which is
fresher than any report. A worker marked dead is never picked.

`cache_aware` also sees what each worker's prefix cache holds (cluster/flow/cache_views.py)
and scores each candidate in blocks, overlap minus load as in Dynamo's KV router: on a
prefill (or colocated) worker, the prompt blocks it would still compute plus the blocks
of prefill already queued there; on a decode worker, the blocks it would still receive
plus those it lacks the free room for, the requests it decodes breaking ties. The
pair's score is the sum of its two members' (nothing in it depends on both ends: the
transfer's size is set by the decode side's hits alone), so each side is minimized on
its own. Imbalance is bounded as in SGLang's gateway: a worker more than `BALANCE_ABS`
requests (and `BALANCE_REL` times) above the least loaded one is not a candidate,
however much of the prompt it holds.

`pick` returns a `Claim`: the request counts against the worker from the pick until
the claim is released, exactly once, by the request that holds it (see
cluster/flow/request.py), so the count stays exact across restarts and failures.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

from cluster.config import RouterPolicy
from cluster.control.worker_info import WorkerInfo
from cluster.flow.cache_views import CacheViews

OVERLAP_WEIGHT = 1.0
"""Blocks of this prompt still to compute/receive, against blocks already claimed."""
BALANCE_ABS = 4
"""Requests a worker may hold above the least loaded candidate and still be chosen..."""
BALANCE_REL = 1.5
"""...or this many times the least loaded one's requests, whichever is more."""


class NoLiveWorkerError(RuntimeError):
    """No live worker of a role: the request cannot be placed now."""

    def __init__(self, role: str, request_id: str | None = None):
        self.role = role
        self.request_id = request_id
        super().__init__(f"[request {request_id}] no live {role} worker")


@dataclass(frozen=True)
class RouteDecision:
    """Why `cache_aware` picked a worker; it lands in `pdserve_timings.route` and metrics."""

    role: str
    worker_id: str
    reason: str
    """`cache` (its overlap won), `load` (overlap did not tell the candidates apart),
    `balance` (a candidate holding more was over the imbalance bound)."""
    cached_blocks: int
    prompt_blocks: int
    score: float
    """Blocks of work: lower won."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Claim:
    """One request's hold on one worker, from `Router.pick` until `release()`."""

    worker: WorkerInfo
    load_tokens: int = 0
    """Added to the worker's `claimed_tokens` while the claim holds."""
    released: bool = field(default=False, init=False)
    generation: int = field(default=0, init=False)
    """The worker's actor incarnation when it was picked: a failure of this request's
    calls is about that incarnation, not a replacement started since."""
    decision: RouteDecision | None = field(default=None, init=False)
    """Set by `cache_aware`: how the worker was chosen."""

    def __post_init__(self) -> None:
        self.worker.in_flight += 1
        self.worker.claimed_tokens += self.load_tokens
        self.generation = self.worker.generation

    def release(self) -> None:
        """Idempotent: the first call gives the worker its seat back."""
        if not self.released:
            self.released = True
            self.worker.in_flight -= 1
            self.worker.claimed_tokens -= self.load_tokens


@dataclass
class LocalPrefill:
    """A decode worker's promise to prefill one prompt itself, counted in its
    `local_prefill_tokens` from the `auto` decision until its first token (or the
    request's close); `release()` is idempotent, like a `Claim`'s."""

    worker: WorkerInfo
    tokens: int
    released: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.worker.local_prefill_tokens += self.tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.local_prefill_tokens -= self.tokens


class Policy:
    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        raise NotImplementedError


class RoundRobin(Policy):
    def __init__(self) -> None:
        self.counter = itertools.count()

    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        return candidates[next(self.counter) % len(candidates)]


class LeastLoaded(Policy):
    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        return min(candidates, key=WorkerInfo.score)


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded wins: near least-loaded at O(1) cost."""

    def __init__(self, seed: int | None = None) -> None:
        self.random = random.Random(seed)

    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        if len(candidates) == 1:
            return candidates[0]
        return min(self.random.sample(candidates, 2), key=WorkerInfo.score)


class CacheAware(Policy):
    """Overlap minus load (see the module docstring); least loaded without a prompt."""

    def __init__(self, views: CacheViews | None = None) -> None:
        self.views = views or CacheViews()

    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        return min(candidates, key=WorkerInfo.score)

    def decide(
        self, role: str, candidates: list[WorkerInfo], tokens: list[int], salt: str | None = None
    ) -> tuple[WorkerInfo, RouteDecision]:
        hashes = self.views.hashes(tokens, candidates, salt)
        block = self.views.block_size or 1
        prompt_blocks = -(-len(tokens) // block)
        scored = sorted(self._score(role, w, hashes, prompt_blocks, block) for w in candidates)
        allowed = {w.worker_id for w in balanced(candidates)}
        eligible = [entry for entry in scored if entry[2] in allowed]
        score, _, _, cached, worker = eligible[0]
        if eligible[0] is not scored[0]:
            reason = "balance"
        elif cached > min(entry[3] for entry in eligible):
            reason = "cache"
        else:
            reason = "load"
        return worker, RouteDecision(role, worker.worker_id, reason, cached, prompt_blocks, score)

    def _score(self, role: str, worker: WorkerInfo, hashes, prompt_blocks: int, block: int):
        """(score, then the tie-breaks, ..., cached blocks, worker): lowest first."""
        cached = self.views.cached_blocks(worker, hashes)
        todo = prompt_blocks - cached
        if role == "decode":
            # Blocks to receive, plus those it would have to wait for; the requests it
            # decodes break ties, and the balance bound keeps a holder from collapsing
            # the pool onto itself.
            free = worker.load.free_blocks if worker.load is not None else todo
            score = OVERLAP_WEIGHT * todo + max(0, todo - free)
        else:  # blocks to compute, against blocks of prefill already queued there
            score = OVERLAP_WEIGHT * todo + worker.claimed_tokens / block
        return (score, worker.in_flight, worker.worker_id, cached, worker)


def balanced(candidates: list[WorkerInfo]) -> list[WorkerInfo]:
    """Candidates within the imbalance bound of the least loaded one (by requests)."""
    least = min(w.in_flight for w in candidates)
    bound = max(least + BALANCE_ABS, least * BALANCE_REL)
    return [w for w in candidates if w.in_flight <= bound]


POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "cache_aware": CacheAware,
}


class Router:
    """Called by the request flow once per request (and again when recovering one)."""

    def __init__(self, policy: RouterPolicy, workers: dict[str, WorkerInfo]):
        self.workers = workers
        self.views = CacheViews()
        """What each worker's prefix cache holds (reports + what was routed there)."""
        make = POLICIES[policy]
        self.policies = {
            role: make(self.views) if make is CacheAware else make()
            for role in ("prefill", "decode", "colocated")
        }

    def live(self, role: str) -> list[WorkerInfo]:
        """Workers of `role` that take requests (alive, and not a standby spare)."""
        return [w for w in self.workers.values() if w.role == role and w.alive and not w.standby]

    def pick(
        self,
        role: str,
        request_id: str | None = None,
        exclude: set[str] | None = None,
        tokens: list[int] | None = None,
        salt: str | None = None,
        predict: bool = True,
    ) -> Claim:
        """A claim on the best live worker of `role` for a prompt of `tokens` (None: no
        prompt to place, load only) with prefix-cache salt `salt`; the caller must
        release it. `predict`: count the tokens' blocks as cached there from now on
        (False when the caller still weighs where they get computed)."""
        candidates = [w for w in self.live(role) if w.worker_id not in (exclude or set())]
        if not candidates:
            raise NoLiveWorkerError(role, request_id)
        policy, decision = self.policies[role], None
        if tokens is None:
            return Claim(policy.choose(candidates))
        if isinstance(policy, CacheAware):
            worker, decision = policy.decide(role, candidates, tokens, salt)
        else:
            worker = policy.choose(candidates)
        hashes = self.views.hashes(tokens, candidates, salt)
        load = len(tokens)
        if role != "decode":  # what it has to compute
            load -= self.views.cached_blocks(worker, hashes) * (self.views.block_size or 0)
        claim = Claim(worker, load)
        claim.decision = decision
        if predict:
            self.views.note(worker.worker_id, hashes)
        return claim

    def pick_holder(
        self, role: str, request_id: str, tokens: list[int], salt: str | None = None
    ) -> Claim:
        """A claim on the live worker of `role` whose prefix cache (as far as the router
        knows) holds the most of `tokens`, the less loaded one on a tie, loaded with the
        tokens it lacks. Called by recovery, where reusing KV a worker computed already
        beats spreading load; the caller must release the claim."""
        candidates = self.live(role)
        if not candidates:
            raise NoLiveWorkerError(role, request_id)
        hashes = self.views.hashes(tokens, candidates, salt)
        cached = {w.worker_id: self.views.cached_blocks(w, hashes) for w in candidates}
        worker = min(candidates, key=lambda w: (-cached[w.worker_id], *w.score()))
        cached_tokens = min(len(tokens), cached[worker.worker_id] * (self.views.block_size or 0))
        return Claim(worker, len(tokens) - cached_tokens)

    def remember_decoded(
        self, worker_id: str | None, tokens: list[int], salt: str | None = None
    ) -> None:
        """A request's decode worker computed the KV of `tokens` (prompt plus all but
        the last output token): the next turn of the conversation may find it there."""
        if worker_id is not None:
            self.views.note_tokens(worker_id, tokens, salt)
