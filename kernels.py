"""
Passes that make the series faster and teach nothing: hand-written forward and backward
passes for three places where torch's own, on a CPU, cost more than they need to. A learner
may skip this file; each function here gives what its plain counterpart gives (the tests
check it against that counterpart).

- log_softmax_at(logits, targets): each target's log-probability, what
  F.log_softmax(logits.float(), -1).gather(-1, targets) gives, without the float32 copy of
  every logit, which DPO, PPO and GRPO would keep for their backward pass.
- attention(q, k, v, visible, dropout, causal): torch's scaled_dot_product_attention, whose
  backward pass runs in float32 where DPO, PPO and GRPO train in bfloat16 on a CPU, as torch's
  CPU kernel computes it faster in float32 than in bfloat16 (bench/turns.py attention measures it).
- block_attention(q, keys, values, visible): a new token's attention over the cache, as a
  step of writing with it runs on a CPU without AMX: two products by hand over a cache kept in
  blocks of CACHE_BLOCK positions, which there take a third of the fused kernel's time in
  bfloat16 and about as long in float32 (bench/decode.py measures both); cache_block(device,
  context) is the block a cache keeps.
"""
import torch
import torch.nn.functional as F

CACHE_ROWS = 32  # rows of logits log_softmax_at takes at a time on a CPU: 32 x 5,376 float32 numbers, 688 KB


def log_softmax_at(logits, targets):
    """log_softmax(logits)[target] for each row's target index, in float32 (float64 for
    float64 logits), with its gradient: F.log_softmax(logits.float(), -1).gather(...) without
    the float32 copy of every logit it makes, and keeps for its backward pass (for a GRPO
    minibatch, 16 x 224 x 5,376 numbers, 77 MB, written and read several times). On a CPU it
    takes CACHE_ROWS rows at a time, few enough that they stay in the cache (a GPU takes all
    the rows at once, in float32); the backward pass works each row's softmax out again from
    the logits."""
    return LogSoftmaxAt.apply(logits, targets)


class LogSoftmaxAt(torch.autograd.Function):
    """log_softmax_at's forward and backward passes."""

    @staticmethod
    def forward(ctx, logits, targets):
        flat, flat_targets = logits.flatten(0, -2), targets.reshape(-1, 1)
        precise = torch.promote_types(logits.dtype, torch.float32)
        # log p(t) = logit_t - log sum_j e^logit_j: the row's log-sum, and its target's logit.
        log_sums = torch.empty(len(flat), dtype=precise, device=logits.device)
        picked = torch.empty_like(log_sums)
        for rows in row_slices(flat):
            chunk = flat[rows].to(precise)
            log_sums[rows] = torch.logsumexp(chunk, dim=-1)
            picked[rows] = chunk.gather(1, flat_targets[rows]).squeeze(1)
        ctx.save_for_backward(logits, targets, log_sums)
        return (picked - log_sums).view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable  # a gradient of the gradient would need the log-sums' own
    def backward(ctx, grad):
        # d log p(t) / d logit_j = [j = t] - softmax_j: the softmax again, from the logits and the row's log-sum.
        logits, targets, log_sums = ctx.saved_tensors
        flat, flat_targets = logits.flatten(0, -2), targets.reshape(-1, 1)
        flat_grad = grad.reshape(-1, 1).to(log_sums.dtype)
        grad_logits = torch.empty_like(flat)  # in the logits' precision, as their own gradient would be
        for rows in row_slices(flat):
            softmax = (flat[rows].to(log_sums.dtype) - log_sums[rows, None]).exp_()
            grad_logits[rows] = softmax.mul_(-flat_grad[rows]).scatter_add_(1, flat_targets[rows], flat_grad[rows])
        return grad_logits.view_as(logits), None


def row_slices(flat):
    """Slices of CACHE_ROWS rows on a CPU; one slice of them all on a GPU, where each slice is a kernel launch."""
    step = CACHE_ROWS if flat.device.type == "cpu" else max(1, len(flat))
    return [slice(start, start + step) for start in range(0, len(flat), step)]


# The CPU kernel that scaled_dot_product_attention calls, forward and backward: torch's private
# operators, so a build may lack them (torch's versions can rename them); attention() then
# takes the public function.
FLOAT32_BACKWARD = all(hasattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"))


# Writing with a cache, a new token's attention reads every cached key and value and multiplies
# little. On a CPU with AMX (Intel's matrix units), torch's fused kernel does it fastest over the
# positions so far; on a CPU without, two products by hand over a cache kept in blocks of 32
# positions take a third of its time in bfloat16 and about as long in float32 (less at 120
# positions, more at 224), so they run there (bench/decode.py times both; episode 16's speed
# page has the figures, an Intel Xeon's and AMD EPYCs').
BY_HAND_ON_CPU = not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
CACHE_BLOCK = 32  # positions in a block of the cache, where block_attention reads it


def cache_block(device, context):
    """Positions in each block of a cache (sample.KVCache): CACHE_BLOCK where a new token's
    attention runs by hand, block_attention; elsewhere one block of the model's whole context,
    whose positions so far torch's fused kernel reads."""
    return CACHE_BLOCK if device.type == "cpu" and BY_HAND_ON_CPU else context


def attention(q, k, v, visible, dropout, causal):
    """torch's scaled_dot_product_attention. For a bfloat16 pass on a CPU that is going to be
    trained through (the updates of DPO, PPO and GRPO: causal, no dropout, no mask), the same
    forward pass, and the backward pass in float32, which torch's CPU kernel computes faster
    than in bfloat16 (bench/turns.py attention measures it). For one query a row over keys
    and values in blocks (a step of writing with the cache of a CPU without AMX), block_attention."""
    if k.dim() == 5:  # blocks, rows, heads, positions of a block, channels: sample.KVCache's blocks
        return block_attention(q, k, v, visible, dropout)
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad and causal and visible is None
            and dropout == 0 and FLOAT32_BACKWARD):
        return CausalAttentionFloat32Backward.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, is_causal=causal)


def block_attention(q, keys, values, visible, dropout=0.0):
    """scaled_dot_product_attention for one query a row (q: rows, heads, 1, channels) over keys
    and values kept in blocks of positions (blocks, rows, heads, positions of a block,
    channels), of which each row sees only `visible` (rows, 1, 1, every block's positions in
    order; None: all): a block's slots not yet written are read too, with weight 0. Each
    product is one of many small dense matrices, which torch multiplies on a CPU without
    copying the cache, fastest where each block's keys lie in memory channel by channel, as
    sample.KVCache keeps them (any layout gives the same answer); the products in the cache's
    precision, the softmax and the sum of the blocks in float32 (float64 for float64 keys)."""
    blocks, block = keys.size(0), keys.size(-2)
    precise = torch.promote_types(keys.dtype, torch.float32)
    # Every block's scores in one product, the query the same for each block (a block's keys
    # transposed, channels by positions: as they lie in the cache's memory); then a row's
    # scores side by side, its positions in order.
    scores = (q @ keys.transpose(-2, -1)).to(precise) * q.size(-1) ** -0.5
    scores = scores.permute(1, 2, 3, 0, 4).flatten(-2)  # made here, not the cache: the mask fills it in place
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))  # positions a row may not see weigh 0
    weights = scores.softmax(dim=-1)
    weights = F.dropout(weights, dropout) if dropout else weights
    # Back in blocks: each block's values weighed in one product, and the blocks' sums added up.
    weights = weights.to(values.dtype).unflatten(-1, (blocks, block)).permute(3, 0, 1, 2, 4)
    return (weights @ values).sum(0, dtype=precise).to(q.dtype)


class CausalAttentionFloat32Backward(torch.autograd.Function):
    """Causal attention whose forward pass is scaled_dot_product_attention's on a CPU, to the
    last bit, and whose backward pass runs in float32 (float64 for float64 inputs), from the
    same saved tensors: the inputs, the output and each query's log-sum of exponentials."""

    @staticmethod
    def forward(ctx, q, k, v):
        # The kernel itself, as the public function drops what it returns beside the output:
        # each query's log-sum of exponentials, which the backward pass needs.
        out, log_sums = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, log_sums)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward pass has no gradient of its own
    def backward(ctx, grad):
        q, k, v, out, log_sums = ctx.saved_tensors
        precise = torch.promote_types(q.dtype, torch.float32)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.to(precise) for t in (grad, q, k, v, out)), log_sums, dropout_p=0.0, is_causal=True)
        # Each gradient in its input's precision, as torch's own backward pass gives them.
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
