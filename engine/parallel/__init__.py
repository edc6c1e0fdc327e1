"""Tensor parallelism inside one worker: the group its ranks share (`group`), who owns
which heads, rows and vocabulary entries (`shard`), the lockstep channel rank 0 drives
its followers with (`step_channel`), and a follower's engine (`follower`)."""
