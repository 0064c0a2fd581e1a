"""The chunkwise engine: the stages every chunkwise mixer (DeltaNet, Gated DeltaNet, GLA, SSD) composes.

Chunk size ``BT = 64``; head dims up to 256 (the state pass keeps two 128-row halves beyond 128).
Every stage takes a :class:`ChunkPlan` (``plan``) from ``prepare_chunks(cu_seqlens, batch, seqlen)``
(cached per shape without packing, carried by a ``Packing`` passed as ``cu_seqlens``): inputs
``[B, T, ...]`` are read as ``[1, B*T, ...]`` with ``cu_seqlens = [0, T, 2T, ...]`` when not packed,
chunks are indexed per sequence (a chunk never straddles two documents), and per-chunk tensors
(``h``, ``dh``) are ``[NT, H, K, V]`` with ``NT`` the total number of chunks over all sequences, in
sequence order. Gates are log-space fp32 and, inside
the engine, already chunk-local cumulative sums (``g_cum``).

Stages (Triton, forward and backward; ``q, k [B,T,H,K]``, ``v, u, v_new [B,T,H,V]``, ``g [B,T,H]``,
``gk [B,T,H,K]``, ``beta [B,T,H]``). In the state and output stages without ``w`` or ``gk``, q and k
may have ``HK < H`` heads, each shared by ``H / HK`` consecutive heads (Mamba2's groups of B and
C, read in place by ``tile.qk_rows``); dq and dk come back per head, for the caller to sum):

- ``index.prepare_chunks(cu_seqlens, batch, seqlen, chunk_size=64) -> ChunkPlan``
- ``cumsum.chunk_local_cumsum(g, plan, *, reverse=False, scale=None) -> g_cum`` (fp32, ``[B,T,H]`` or
  ``[B,T,H,K]``; ``scale [H]`` multiplies each head's terms). Its backward is the same call with
  ``reverse=True``.
- ``wy.wy_fwd(k, v, beta, plan, *, g=None, Ai=None, q=None) -> (w, u, Ainv)``:
  ``A = tril(diag(beta) K K^T ⊙ Γ, -1)``, ``Γ_ij = exp(g_i - g_j)`` (1 without g),
  ``Ainv = (I + A)^-1`` (``[B,T,H,BT]`` in k's dtype, formed in fp32), ``T = Ainv diag(beta)``,
  ``w = T (k ⊙ exp(g))``, ``u = T v``. With ``q`` also the chunks' scores ``q k^T ⊙ causal ⊙ Γ``
  (``[B,T,H,BT]`` in q's dtype), fourth, for the state walks to read (``state.walk_reads_scores``).
- ``wy.wy_bwd(k, v, beta, Ainv, dw, du, plan, *, g=None, dk=None, dg=None)
  -> (dk, dv, dbeta, dg)``: adds the WY gradients to ``dk`` (fp32 partial or None) and to ``dg``
  (cumulative-gate space) and returns ``dg`` already mapped back to the raw gate (reverse cumsum).
- ``state.state_fwd(k, u, plan, *, w=None, g=None, gk=None, u_scale=None, initial_state=None,
  output_final_state=False, q=None, scale=1.0, keep_h=True, scores=None, skip=None, again=False) -> (h,
  v_new, final_state)``: ``h[c]``
  is the state before chunk c; ``v_new = u - w h`` (``v_new is u`` without ``w``); the state update is
  ``h <- exp(g_last) h + (k ⊙ exp(g_last - g))^T v_new`` (per key row with ``gk``). ``u_scale``
  (``[B,T,H]``, without ``w``) scales u's rows inside the pass (SSD's ``v = x dt``; v_new None).
  With ``q`` the walk also forms ``output_fwd``'s o and returns it fourth (``keep_h=False``: h is
  not written, None; ``scores``: it reads ``wy_fwd``'s scores instead of forming them; ``skip``
  ``[H]``: plus ``skip[h] u``, SSD's ``D x``; with ``gk``, GLA's o from ``scores`` its A, by the
  walk only); ``state.walk_forms_output`` says when the delta rules and GLA ask it to,
  ``ssd.chunk.walk_forms_ssd_output`` when SSD does, ``state.walk_can_form_output`` where the walk
  can (else the output launch, which takes neither ``u_scale`` nor ``skip``). ``again``: a
  backward's walk forming the states again, tuned apart from the forward's walk.
- ``state.state_bwd(q, k, do, dv, plan, *, scale, w=None, g=None, gk=None, dht=None,
  need_dh0=False, intra_dv=False, scores=None, dv_out=None, values=None) -> (dh, dh0, dv2)``:
  ``dh[c]`` is the gradient of the state
  *after* chunk c, ``dv`` the intra-chunk gradient of ``v_new``, ``dv2 = dv + (k ⊙ decay) dh`` its
  full gradient (``dv=None``, without ``w``: dh alone and ``dv2`` None, for a caller that forms it
  itself; ``dv=None, intra_dv=True``: the walk forms ``output_bwd_dv``'s dv from the tiles it
  loads, or from ``scores``, ``state.walk_forms_dv`` says when the delta rules ask it to; with
  ``gk``, ``scores`` GLA's A and ``values`` its v, also ``dA``, returned fourth, where
  ``state.walk_forms_dv_dA`` holds).
- ``output.output_fwd(q, k, v_new, h, plan, *, scale, g=None) -> o``:
  ``o = (q ⊙ exp(g)) h * scale + (q k^T ⊙ causal ⊙ Γ) v_new * scale``.
- ``output.output_bwd_dv(q, k, do, plan, *, scale, g=None) -> dv``: the intra-chunk gradient of
  ``v_new`` (``(q k^T ⊙ causal ⊙ Γ)^T do * scale``).
- ``output.output_bwd_dqk(q, k, v_new, h, dh, do, plan, *, scale, g=None, dv=None, h0=None)
  -> (dq, dk, dw, dg)``: dq and dk in q's dtype (dk completed by ``wy_bwd`` for delta rules),
  dw = -dv h^T when ``dv`` (the full ``dv2``) is given, dg in cumulative-gate space (fp32). With
  ``h=None`` (no gate; ``output.dqk_walks`` says when) it walks the chunks and forms the states
  from ``h0`` as it goes.
- ``two_level``: the state pass of long sequences without ``w`` that ``state_fwd`` / ``state_bwd``
  choose (``chunk_terms``, ``scan``, ``dv_with_states``; ``state``'s module docstring says when).
- ``tile.tile(base, r0, c0, n_r, n_c, s_r, s_c, BR, BC) -> (pointers, mask)``: pointer tiles
  (Triton 3.9 removed block pointers), and ``tile.load_tile`` / ``tile.store_tile`` over them.
- ``overlap.beside(fn, device) -> join``: ``fn``'s launches on a second CUDA stream after the work
  queued so far, ``join()`` their result once the current stream has waited for them (at once off
  the GPU); GLA's backward forms its states again this way (``overlap``'s docstring says why only it).
- ``approx.fast_exp(x)`` / ``approx.fast_sigmoid(x)``: fp32 exp and sigmoid by ``ex2.approx.ftz`` and
  ``div.approx`` on the GPU (results below 2^-126 flushed to 0), ``tl.exp`` / ``tl.sigmoid`` under the
  interpreter; every stage of the engine and the short conv take them.
- ``index.tuned(stage, **defaults)`` / ``index.TUNING``: launch parameters per stage, overridable
  for sweeps (``ttr bench --stages --sweep``); never set in normal use.
- ``torch_chunk.chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
  cu_seqlens)``: the chunkwise form in torch, the CPU backend of every chunk op (g none, per head
  or per key; beta for the delta rules), autograd through torch ops.
"""
