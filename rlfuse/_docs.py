"""The docstrings of the public functions, written once: ``documented`` gives them to the
reference twins, and ``_dispatch.falls_back_to`` hands the twin's to each fused function."""
from __future__ import annotations

from typing import Callable

DOCSTRINGS = {}

DOCSTRINGS["token_logprobs"] = """\
Per-token log-probs of ``targets`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]`` or ``[N, V]``, bf16/fp16/fp32/fp64; any batch and time strides
            (``logits[:, :-1]`` is used without a copy).
        targets: integer ids ``[B, T]`` / ``[N]``; unmasked ones must lie in ``[0, V)``.
        temperature: log-probs are ``log_softmax(logits / temperature)``; must be > 0.
        return_entropy: also return the entropy ``lse - sum_v p_v z_v`` of each position.
        inplace_backward: write the gradient w.r.t. the logits into the logits' own buffer (saves
            a logits-sized allocation; only safe when nothing else needs the logits afterwards;
            the reference accepts it and has no such buffer to save).
        mask: optional ``[B, T]`` / ``[N]`` bool (or 0/1); masked positions get log-prob 0,
            entropy 0 and zero gradient, and their targets are never read.
        validate: check the mask holds 0/1 and the unmasked targets lie in ``[0, V)`` (reads
            ``[B, T]`` data, one host sync); without it an out-of-range target gives NaN, never
            an out-of-bounds read.

    Returns:
        ``logp`` (fp32; fp64 for fp64 logits), or ``(logp, entropy)``::

            z = logits / temperature,  lse = logsumexp(z),  logp = z[y] - lse
            entropy = lse - sum_v softmax(z)_v z_v

    Fused (``rlfuse.token_logprobs``): the forward reads the logits once and saves two fp32
    numbers per position (the row max and the log-sum of the shifted exponentials, whose sum is
    the logsumexp); the backward reads the logits once more and writes the gradient once.
    """

DOCSTRINGS["policy_logprobs"] = """\
Per-token log-probs ``[B, T]`` (fp32; fp64 for fp64 inputs) of any policy form, with
    autograd — the old or reference log-probs a trainer needs, and the entropy for a bonus,
    without a ``[B, T, V]`` tensor when the policy is a ``LinearHead``.

    Args:
        policy: ``rlfuse.Logits``, ``rlfuse.LinearHead`` or ``[B, T]`` log-probs (returned as
            they are; they carry no entropy).
        return_entropy: also return the entropy of each position.
        validate: check that every target lies in ``[0, V)`` (one host sync); without it an
            out-of-range target gives NaN, never an out-of-bounds read.

    Returns:
        ``logp`` or ``(logp, entropy)``. Fused (``rlfuse.policy_logprobs``): from ``Logits`` the
        log-prob kernels (one read forward, one read and one write backward); from
        ``LinearHead`` each chunk's logits are formed by one matmul in the forward and once more
        in the backward, where they turn into the gradients of the hidden states, weight and
        bias.
    """

DOCSTRINGS["ggpo_loss"] = """GGPO: the stable Gibbs (log-mean-exp) gap of KL-adjusted rewards.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        ref_logprobs: ``[B, T]`` log-probs of the reference policy (detached; garbage allowed at
            masked positions).
        rewards: ``[B]`` sequence rewards.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        group_size: ``m >= 2``; rows ``[g m, (g + 1) m)`` form group ``g``.
        beta: KL weight ``> 0`` (a runtime kernel argument: changing it does not recompile).
        clip_radius: ``ρ`` (> 0, may be ``inf``) selects the clipped branch.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_tokens: the token count ``T_tok`` of the whole minibatch (for gradient accumulation
            and data parallelism); default: ``mask.sum()``.
        validate: check the values of the ``[B, T]`` inputs (0/1 mask, finite values at actor
            positions, a token in every group); shapes and devices are always checked.

    No behavior log-probs and no importance ratio enter the loss::

        s_i = Σ_t M_it lp_it        s_i^ref = Σ_t M_it ref_lp_it
        R_i = r_i − β (s_i − s_i^ref)
        J_g = β log( (1/m) Σ_{i∈g} exp(R_i/β) ) − (1/m) Σ_{i∈g} R_i       (≥ 0; 0 iff all R_i equal)
            = β ( logsumexp_i z_i − log m ),  z_i = (R_i − mean_g R)/β
        T_tok = Σ M (argument num_tokens),  ℓ̄ = T_tok / B
        L = (1/G) Σ_g J_g / (β ℓ̄ √(m−1))  =  m Σ_g J_g / (β √(m−1) T_tok)
        q_i = softmax_{i∈g}(R_i/β),  c_i = (m q_i − 1)/√(m−1)
        ∂L/∂lp_it = − c_i M_it / T_tok

    ``z`` is formed as ``(r_i − mean_g r)/β − (Δ_i − mean_g Δ)`` with ``Δ = s − s^ref`` (the
    same value, without scaling the log-probs by β and back), and ``J_g/β`` is never multiplied
    out, so β from 1e-2 to 1e1 with large rewards stays finite. The gradient is autograd's.

    ``clip_radius = ρ`` (may be ``inf``) selects the clipped branch::

        d_it = clamp(lp_it − ref_lp_it, −ρ, ρ)   (detached)
        R̃_i = r_i − β Σ_t M_it d_it,  q̃ = softmax_g(R̃/β),  c̃_i = (m q̃_i − 1)/√(m−1)  (detached)
        L_clip = −(1/T_tok) Σ_i c̃_i s_i,   ∂L_clip/∂lp_it = −c̃_i M_it / T_tok

    (the clamped LME is never differentiated; with ρ = ∞ both branches have the same gradient).
    With a global ``num_tokens`` the losses of micro-batches of whole groups add up to the
    full-batch loss.

    Metrics (detached): ``gap`` mean over groups of J_g/β (unclipped J, both branches);
    ``q_max`` max over the batch of the weights of the update (q, or q̃ in the clipped branch);
    ``clip_frac`` share of actor tokens with |lp − ref_lp| > ρ (0 without ``clip_radius``);
    ``seq_logratio_mean`` mean over sequences of s_i − s_i^ref; ``kl`` mean over actor tokens
    of the k3 estimate e^d − d − 1, d = ref_lp − lp clamped to ±20 (TRL's ``kl``).

    Fused (``rlfuse.ggpo_loss``): from log-probs one group kernel (one program per group) and one
    token-gradient kernel; from ``Logits`` the log-prob pass over the logits, the group kernel
    and one backward pass that writes ``dlogits``: two reads and one write of the logits; from
    ``LinearHead`` the same, each chunk's logits formed in the log-prob pass and once more in
    the backward.
    """

DOCSTRINGS["gppo_bounds"] = """Per-token trust region ``[lo, hi] = {r : D(r) <= delta}`` of GPPO.

    Args:
        old_logprobs: behavior-policy log-probs of any shape (bounds are elementwise).
        geometry: ``tv``, ``chi2``, ``hellinger``, ``kl`` or ``two_sided_log``.
        topology: ``mc``, ``atomic`` or ``binary``.
        delta: region size ``> 0``, or ``(delta_low, delta_high)``.

    ``mu = exp(old_logprobs)`` clamped to ``[1e-6, 1 - 1e-6]``; ``r = pi_new / pi_old``.
    ``delta`` may be a pair ``(delta_low, delta_high)``: the lower bound is that of
    ``delta_low``'s region, the upper that of ``delta_high``'s (an asymmetric region).
    Integrands ``f``: ``tv`` ½|r−1| · ``chi2`` (r−1)² · ``hellinger`` (√r−1)² · ``kl`` −log r ·
    ``two_sided_log`` |log r|. Topologies: ``mc`` D = f(r) · ``atomic`` D = μ f(r) ·
    ``binary`` D = μ f(r) + (1−μ) f((1−μr)/(1−μ)) (Bernoulli(μ) vs Bernoulli(μr), r ≤ 1/μ).
    Closed forms (``w = delta`` for mc, ``delta/mu`` for atomic)::

        tv         mc/atomic [1 − 2w, 1 + 2w]          binary [1 − δ/μ, min(1/μ, 1 + δ/μ)]
        chi2       mc/atomic 1 ± √w                    binary 1 ± √(δ(1−μ)/μ), hi ≤ 1/μ
        hellinger  mc/atomic [(1−√w)₊², (1+√w)²]       binary π ∈ [sin²(max(0, α−θ)),
                                                               sin²(min(π/2, α+θ))] / μ,
                                                       α = asin √μ, θ = acos(max(−1, 1−δ/2))
        kl         mc/atomic [e^{−w}, +inf)            binary roots of μ log(μ/π) +
                                                               (1−μ) log((1−μ)/(1−π)) = δ
        two_sided_log  [e^{−w}, e^{w}]                 binary roots of μ|log r| +
                                                               (1−μ)|log((1−μr)/(1−μ))| = δ

    Lower bounds clamp at 0; an upper bound that does not fit the dtype is ``+inf``. The binary
    upper bound never exceeds the domain edge ``1/μ`` (π = 1): that is the ``min`` of the tv cell,
    applied to chi2 as well (its quadratic root passes 1/μ once δ > (1−μ)/μ). Hellinger/binary
    uses the trig-free form of the SPEC (``c = max(−1, 1−δ/2)``, ``s = √(1−c²)``, ``a = √μ``,
    ``b = √(1−μ)``: ``π_lo = (ac − bs)²`` if ``ac − bs > 0`` else 0, ``π_hi = (ac + bs)²`` if
    ``bc − as > 0`` else 1). kl/binary and two_sided_log/binary are the roots of ``D = δ`` on each
    side of r = 1, found in fp64 (each side has exactly one: D is 0 at r = 1, monotone on each
    side and unbounded at both ends of the domain).

    All bounds are computed in fp64; they come back in fp64 for fp64 input, fp32 otherwise.
    Elementwise: a NaN ``old_logprobs`` gives NaN bounds.
    Check value: chi2/atomic, μ = 0.1, δ = 0.04 → [0.3675445, 1.6324555].
    """

DOCSTRINGS["gppo_loss"] = """\
GPPO: the policy-gradient surrogate clipped to each token's f-divergence trust region.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` behavior-policy log-probs (detached), or None on policy
            (``old = lp.detach()``, r = 1; the region then centres on the learner's own μ).
        advantages: ``[B]`` / ``[B, 1]`` (per sequence, broadcast over its tokens) or ``[B, T]``.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        geometry: ``tv``, ``chi2``, ``hellinger``, ``kl`` or ``two_sided_log``.
        topology: ``mc``, ``atomic`` or ``binary``.
        delta: region size ``> 0``, or ``(delta_low, delta_high)``: the lower bound from the
            first, the upper from the second (runtime kernel arguments).
        agg: ``token-mean`` (default), ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm``, ``token-sum`` (verl's names and divisors, below). A
            response without actor tokens contributes 0 and counts in the default
            ``num_sequences``.
        dual_clip: ``c > 1``: for ``A < 0`` the token objective is
            ``max(min(r A, clip(r) A), c A)`` (verl's ``clip_ratio_c``); None: no dual clip.
        weights: optional ``[B, T]`` non-negative per-token multipliers of J (an
            importance-sampling correction, an entropy or off-policy mask); detached.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_tokens, num_sequences: global counts for gradient accumulation / data parallelism,
            numbers or 0-dim tensors (default: the local ones; the count an ``agg`` does not
            use is ignored).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``r A``
            (host syncs); shapes, dtypes and devices are always checked.

    Per actor token::

        r = exp(lp − old_lp),   [l, u] = gppo_bounds(old_lp, geometry, topology, delta)
        J_t = w_t min(r A, clip(r, l, u) A)        (A < 0 with dual_clip: w_t max(…, c A))
        ∂J_t/∂lp_t = w_t A r · 1[active],
        active = ¬((A > 0 ∧ r > u) ∨ (A < 0 ∧ r < l) ∨ (A < 0 ∧ r > c))
        loss = −loss_scale · agg(J)

    ``active`` is decided in log space and only the selected branch is exponentiated, so a
    clipped token with any log-ratio is finite; an unclipped ``r A`` that overflows raises
    ``ValueError`` (with ``validate=False``: the ``overflow`` metric is 1 and the loss is not
    finite). ``token-mean`` divides by ``num_tokens`` (default: the local actor-token count), the
    ``seq-mean-*`` ones by ``num_sequences`` (default: the local ``B``); ``seq-mean-token-mean``
    also by each sequence's token count and ``seq-mean-token-sum-norm`` by the padded length T.

    Metrics (detached, over the local actor tokens, 0 when there are none):
    ``clip_frac_low`` share of tokens with A < 0 and r < l (clipped from below);
    ``clip_frac_high`` share with A > 0 and r > u; ``clip_frac_low_seq_min`` /
    ``clip_frac_high_seq_max`` the least / greatest of those shares over the sequences with
    tokens (TRL's ``clip_ratio/low_min`` / ``high_max``); ``dual_clip_frac`` share with A < 0
    and r > c; ``ratio_mean`` mean of r; ``approx_kl`` mean of ``old_lp − lp``, each clamped to ±20
    (verl's ``ppo_kl``);
    ``overflow`` 1 if some selected ``r A`` overflowed.

    Fused (``rlfuse.gppo_loss``): from log-probs one forward and one backward kernel; from
    ``Logits`` one kernel computes the log-probs, the loss and ``dlogits`` in a single pass;
    from ``LinearHead`` that pass on each chunk of the logits.
    """

DOCSTRINGS["group_advantages"] = """\
GRPO advantages: rewards centred (and scaled) within each group of ``group_size`` rows.

    Args:
        rewards: ``[B]`` sequence rewards, finite.
        group_size: rows ``[g m, (g + 1) m)`` form group ``g``; ``B % group_size == 0``.
        eps: added to the standard deviation (> 0 when ``normalize_std``).
        normalize_std: divide by the group's standard deviation (False: Dr. GRPO).

    ``A_i = (r_i − mean_g r) / (std_g r + eps)``, or ``r_i − mean_g r`` with
    ``normalize_std=False`` (Dr. GRPO). ``std`` is the sample standard deviation (ddof = 1,
    ``torch.std``'s default), as verl's ``compute_grpo_outcome_advantage`` and TRL's
    ``GRPOTrainer`` use. A group of one row follows verl: mean 0 and std 1, so ``A = r/(1+eps)``.
    ``eps`` must be > 0 when ``normalize_std`` (a group of equal rewards has std 0). Returns [B]
    in fp32 (fp64 for fp64 rewards), detached.
    """

DOCSTRINGS["gr_opd_advantages"] = """\
GR-OPD's group-relative sequence credit, one advantage per response (``[B]``, detached).

    Args:
        old_logprobs: ``[B, T]`` log-probs of the sampling student.
        teacher_logprobs: ``[B, T]`` log-probs of the frozen teacher on the student's tokens.
        mask: ``[B, T]`` bool (or 0/1): the response tokens; every response needs one.
        group_size: responses per prompt; rows ``[g m, (g + 1) m)`` form group ``g``.
        gamma: the discount over a response's actor tokens, in (0, 1].
        lam: the share of the group mean kept in the advantage.
        feedback_clip, adv_clip: clamps (>= 0) of the per-token feedback and the advantage.
        std_eps: added to the group's population std (> 0).
        validate: check the values of the ``[B, T]`` inputs (host syncs).

    ::

        r_it = clamp(teacher_lp_it − old_lp_it, −feedback_clip, feedback_clip)
        S_i  = Σ_k γ^{k−1} r_{i,t_k} / Σ_k γ^{k−1}
               (t_k = k-th actor token of response i, k = 1..T_i)
        μ_g, σ_g = mean and POPULATION std (ddof=0) of S over the group
        A_i  = clamp( (S_i − μ_g + λ μ_g) / (σ_g + std_eps), −adv_clip, adv_clip )

    The discount counts actor tokens only: it restarts at every response and skips masked
    positions. A group of equal scores (σ = 0) gives ``clamp(λ μ_g / std_eps)``, finite.
    Computed in fp32 (fp64 when either input is fp64); every response needs an actor token.
    ``gamma`` in (0, 1], clips >= 0, ``std_eps`` > 0. ``validate=False`` skips the value checks
    (finite inputs at actor tokens, a token in every response; host syncs): a response without
    one then scores 0. Call it once per rollout on the whole batch and pass ``advantages=`` to
    ``gr_opd_loss`` for every micro-batch (fused: one kernel, one program per group).
    """

DOCSTRINGS["gr_opd_loss"] = """\
GR-OPD: PPO on the student's tokens with the group-relative teacher credit ``A_i``.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` log-probs of the sampling student (detached).
        teacher_logprobs: ``[B, T]`` log-probs of the frozen teacher replayed on the student's
            tokens (detached).
        mask: ``[B, T]`` bool (or 0/1): the response tokens; every response needs one.
        group_size: responses per prompt; rows ``[g m, (g + 1) m)`` form group ``g``.
        gamma, lam, feedback_clip, adv_clip, std_eps: the advantage (see
            :func:`gr_opd_advantages`); all runtime kernel arguments.
        eps: PPO clip range ``[1 − eps, 1 + eps]``, or ``(eps_low, eps_high)`` for
            ``[1 − eps_low, 1 + eps_high]``.
        advantages: precomputed ``[B]`` (or ``[B, 1]``) advantages (from
            ``gr_opd_advantages`` on the whole rollout); ``teacher_logprobs`` then only feeds
            the ``feedback_mean`` metric.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_sequences: the global number of responses ``B`` (default: the local one).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``ρ A``
            (host syncs); shapes, dtypes and devices are always checked.

    ::

        ρ_it = exp(lp_it − old_lp_it)
        L    = −(1/B) Σ_i (1/T_i) Σ_t M_it min(ρ_it A_i, clip(ρ_it, 1−ε, 1+ε) A_i)
        ∂L/∂lp_it = −A_i ρ_it 1[active_it] M_it / (B T_i)

    Per-response token mean first, then the mean over responses (never a global token mean);
    ``B`` is ``num_sequences``. The PPO branch is chosen in log-ratio space and only the selected
    branch is exponentiated; when it is the unclipped negative-advantage branch and ``ρ A``
    overflows the compute dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64) this raises
    ``ValueError`` rather than returning inf/NaN (``validate=False``: the ``overflow`` metric).

    Metrics (detached): ``clip_frac`` share of actor tokens where the clipped branch is
    selected, ``clip_frac_low`` / ``clip_frac_high`` the shares clipped from below (A < 0)
    and above (A > 0); ``adv_mean`` / ``adv_abs_mean`` mean of A_i / |A_i| over the responses;
    ``feedback_mean`` mean of the clamped feedback r_it over actor tokens (computed from
    ``teacher_logprobs`` also when ``advantages`` are given); ``overflow`` as in GPPO.

    Fused (``rlfuse.gr_opd_loss``): the advantage kernel, then GPPO's surrogate kernels with the
    fixed region ``[1 − ε, 1 + ε]``; from ``Logits`` one single pass over the logits, from
    ``LinearHead`` that pass on each chunk of the logits.
    """

DOCSTRINGS["ppo_loss"] = """\
The PPO clipped surrogate, as GRPO / DAPO / Dr. GRPO / GSPO trainers run it.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` log-probs of the policy that sampled the tokens (detached), or
            None on policy (``old = lp.detach()``: ratio 1; from logits or a head the kernel
            forms it itself, no extra pass).
        advantages: ``[B]`` / ``[B, 1]`` (per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        clip: ``eps`` or ``(eps_low, eps_high)``, each in (0, 1): the region
            ``[1 − eps_low, 1 + eps_high]`` (DAPO's clip-higher, TRL's ``epsilon_high``,
            verl's ``clip_ratio_low`` / ``clip_ratio_high``).
        dual_clip: ``c > 1``: for ``A < 0`` the token objective is
            ``max(min(r A, clip(r) A), c A)`` (verl's ``clip_ratio_c``); None: no dual clip.
        ratio_level: ``"token"`` (r per token) or ``"sequence"`` (GSPO: every token of row i
            takes ``s_i = exp(mean over its actor tokens of lp − old)``, clipped as r is; the
            gradient flows through the mean, ``∂s_i/∂lp_it = s_i / T_i``; TRL's
            ``importance_sampling_level="sequence"``).
        agg: ``token-mean`` (default), ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm``, ``token-sum`` (verl's names and divisors, as in
            ``gppo_loss``). A response without actor tokens contributes 0 and counts in the default
            ``num_sequences``. TRL's loss types: ``grpo`` = ``seq-mean-token-mean``, ``bnpo`` =
            ``token-mean``, ``dr_grpo`` = ``token-mean`` with ``num_tokens = B ·
            max_completion_length``, ``dapo`` = ``token-mean`` with the global token count.
        weights: optional ``[B, T]`` non-negative per-token multipliers of J (vLLM's
            importance-sampling correction, an entropy or off-policy mask); detached.
        loss_scale: multiplies the loss and every gradient inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``).
        num_tokens, num_sequences: global counts, numbers or 0-dim tensors (default: the
            local ones).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``r A``
            (host syncs); shapes, dtypes and devices are always checked.

    Per actor token, ``r = exp(lp − old)`` (or ``s_i``)::

        J_t = w_t min(r A, clip(r, 1 − eps_low, 1 + eps_high) A)   (A < 0, dual: max(…, c A))
        loss = −loss_scale · agg(J)

    decided in log space as in ``gppo_loss`` (only the selected branch is exponentiated; an
    overflowing unclipped ``r A`` raises, or is the ``overflow`` metric without validation).
    Metrics: ``clip_frac_low``, ``clip_frac_high``, their per-sequence extremes
    ``clip_frac_low_seq_min`` / ``clip_frac_high_seq_max``, ``dual_clip_frac``, ``ratio_mean``,
    ``approx_kl``, ``overflow`` (as GPPO's).

    Fused (``rlfuse.ppo_loss``): GPPO's kernels with PPO's region — from ``Logits`` /
    ``LinearHead`` one pass for the token-level ratio; the sequence-level ratio needs every
    log-prob of a row first, so it runs the log-prob pass and the surrogate on ``[B, T]``.
    """


DOCSTRINGS["policy_loss"] = """\
Any policy objective TRL or verl runs, with a KL penalty, an entropy bonus and TRL's masks.

    Args:
        policy: ``[B, T]`` learner log-probs (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` behaviour log-probs, or None (on policy: ``old = lp``).
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        objective: an instance of ``rlfuse.objectives`` (``Clip``, ``GPPO``, ``CISPO``,
            ``CISPOTRL``, ``SAPO``, ``SAPOTRL``, ``GPG``, ``DRO``, ``DPPOTV``, ``DPPOKL``,
            ``GSPO``, ``GSPOTRL``, ``LUSPO``, ``GeoMean``, ``VESPO``, ``ClipCov``, ``KLCov``)
            or its name (its defaults; ``"dro"`` has none).
        agg: verl's aggregation of the objective and the KL term (default ``token-mean``); an
            objective that fixes its own (``SAPO``, ``LUSPO``) refuses another.
        weights: optional ``[B, T]`` multipliers (>= 0) of the objective (not of the terms);
            ``VESPO`` takes them as importance ratios into its weight, as TRL does.
        ref_logprobs: ``[B, T]`` reference log-probs of the KL penalty (with ``kl``).
        kl: ``rlfuse.terms.KLPenalty(coef, estimator, clamp, importance_weighted)``.
        entropy: ``rlfuse.terms.EntropyBonus(coef, agg, ...)`` (needs ``Logits`` /
            ``LinearHead``).
        entropy_mask: ``rlfuse.terms.TopEntropyMask(quantile, process_group)`` (TRL's
            ``top_entropy_quantile``; needs ``Logits`` / ``LinearHead``).
        off_policy_mask: ``rlfuse.terms.OffPolicyMask(threshold, sampling_logprobs)`` (TRL's
            OPSM).
        loss_scale: multiplies the loss and every gradient.
        num_tokens, num_sequences: the global counts of ``agg`` (default: the local ones).
        generator: the ``torch.Generator`` of ``ClipCov``'s random choice (default: torch's
            default generator, as verl draws it).
        validate: check the values of the ``[B, T]`` inputs (log-probs <= 0 and finite at
            actor tokens) and refuse an overflowing objective (host syncs).

    With ``r = exp(lp − old)`` per actor token and ``J`` the objective's value::

        loss = −loss_scale agg(w J) + kl.coef agg(KL(lp, ref)) − entropy.coef agg_H(H)

    ``rlfuse.objectives`` gives each objective's formula; ``rlfuse.terms`` the terms'. The
    masks multiply ``w``; the entropy bonus covers the tokens the entropy mask keeps.

    Metrics (detached, over the local actor tokens): a token-local or sequence objective's
    flags (``clip_frac_low`` / ``clip_frac_high`` / ``dual_clip_frac`` of ``Clip``, GSPO and
    LUSPO; ``clip_frac`` / ``clip_frac_high`` of CISPO; ``dropped_frac`` / ``truncated_frac`` of
    DPPO; with ``clip_frac_low`` / ``clip_frac_high`` their per-sequence extremes
    ``clip_frac_low_seq_min`` / ``clip_frac_high_seq_max``), ``ratio_mean``, ``approx_kl``
    (the mean of ``old − lp``, each clamped to ±20 where verl's own loss clamps it) and ``overflow``; a batch-level objective's own (``GeoMean``:
    ``clip_frac_high``, ``clip_frac_low``, ``approx_kl``; ``VESPO``: ``phi_mean``,
    ``approx_kl``; ``ClipCov``: ``cut_frac``, ``approx_kl``; ``KLCov``: ``approx_kl`` of
    ``|lp − old|``); ``kl`` (the mean KL term), ``entropy`` (the mean entropy),
    ``entropy_mask_frac`` and ``off_policy_mask_frac`` (the shares of actor tokens kept).

    Fused (``rlfuse.policy_loss``): a token-local objective with its terms runs the surrogate
    kernels, in one pass over the logits from ``Logits`` / ``LinearHead``; a sequence- or
    batch-level objective or a mask runs the log-prob kernels first, then the loss on
    ``[B, T]``.
    """

DOCSTRINGS["kl_penalty"] = """\
Per-token KL estimates of a policy against reference log-probs (verl's ``kl_penalty``).

    Args:
        logprobs: learner log-probs, any shape (the gradient flows to them).
        ref_logprobs: reference log-probs of the same shape (detached).
        estimator: ``k1`` / ``kl``, ``abs``, ``k2`` / ``mse``, ``k3`` / ``low_var_kl``, each
            with verl's ``+`` (the estimator's value, k2's gradient).
        clamp: verl's clamps of k3 (``ref − lp`` to ±20, the value to ±10); TRL clamps
            nothing.

    With ``d = lp − ref``: k1 ``d``, abs ``|d|``, k2 ``d²/2``, k3 ``e^(−d) + d − 1``. Returns
    fp32 (fp64 for fp64 inputs).

    Fused (``rlfuse.kl_penalty``): one elementwise kernel forward, one backward.
    """


def documented(fn: Callable) -> Callable:
    """Gives ``fn`` the docstring of the public function of its name."""
    fn.__doc__ = DOCSTRINGS[fn.__name__]
    return fn
