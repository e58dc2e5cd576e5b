"""The servers backend (``rollout.placement: separate``): stock ``vllm serve`` processes, started
by the job's rollout ranks (:mod:`.launch`) or by the user (``rollout.server_urls``), driven over
HTTP (:mod:`.client`) by :class:`~rlep_megatron.rollout.servers.engine.ServerEngine` and its
request driver (:mod:`.requests`).

- Generation is token in / token out (vLLM's ``/inference/v1/generate``): the prompt goes as
  token ids and the response comes back as token ids with each token's log-prob, so no
  detokenise / re-tokenise round trip changes a sample. Each response is one request with
  its own seed (``request_seed(...) + j``, as the colocated engine seeds the j-th sample), so
  with the same weights a server samples what the colocated engine samples.
- Weights go through vLLM's weight-transfer lifecycle (``/start_weight_update``,
  ``/update_weights`` per bucket, ``/finish_weight_update`` with the policy version as the
  server's weight version): the HF tensors of :class:`~rlep_megatron.weight_sync.WeightStreamer`
  over vLLM's ``nccl`` engine on GPU, or ``rlep_gloo`` (:mod:`.gloo_transfer`) on the host.
  With LoRA in ``rollout.lora_sync=adapter`` the servers load the base themselves and each
  update is a new vLLM LoRA adapter (:mod:`.adapters`).
- Around each update, ``/pause`` and ``/resume``: ``rollout.carry_over`` ``resume`` or
  ``restart`` abort the requests in flight (their tokens so far come back and are kept, or
  dropped) and submit them again after the update; ``keep`` freezes them on the server, and
  they continue under the new weights with the KV cache they had. Every token is tagged with
  the version that sampled it: from the server's weight-version spans where it gives them,
  else from the version the request was submitted under.
- Failure: a server that stops answering for ``rollout.server_timeout_s`` ends the trainer
  with an error naming it (a watchdog checks ``/health`` also while the trainer trains); a
  failed request fails the step that waits for it.

One trainer rank (global rank 0) drives the servers and sends the weights; the responses reach
the other trainer ranks through the same gather as the colocated engine's replicas use.
"""
