"""Training: state, checks, steps, loop, evaluation/export, checkpoints, metrics.

The public API (what experiments and drivers use; import the modules, nothing is re-exported here):

  trainer.train_and_evaluate(config, workdir) -> final eval metrics    --mode=train, resuming from WORKDIR
  evaluation.evaluate(config, workdir, checkpoint=None) -> metrics     --mode=eval (a train checkpoint or export)
  evaluation.export(config, workdir) -> path                           --mode=export (params-only)
  evaluation.evaluate_sets(eval_step, params, rest, sets, mesh)        per-source held-out loss/perplexity/accuracy
  evaluation.load_params(config, workdir, mesh)                        (cfg, graphdef, params, rest, what)
  state.build_model(cfg, rngs)                                         TextModel or VLModel, from the model config
  state.abstract_state(cfg, tx, mesh)                                  (graphdef, sharded ShapeDtypeStructs, shardings)
  state.init_state(cfg, tx, mesh, seed)                                (graphdef, TrainState born sharded, shardings)
  steps.forward(graphdef, params, rest, batch)                         (logits, aux); head=False: (hidden, aux)
  steps.make_train_step(graphdef, tx, schedule, moe_aux_coef=, kl_weight=, router_bias_rate=, loss_chunk=0)
  steps.make_eval_step(graphdef, loss_chunk=0)
  steps.to_global(host_batch, mesh)                                    host numpy batch -> global jax.Arrays
  checks.check_host_batch(batch, cfg, what)                            the eager checks of every batch
  checkpoint.make_checkpointer(config, workdir)                        WORKDIR/checkpoints
  metrics.read_metrics(workdir)                                        the rows of WORKDIR/metrics.jsonl
  config_lib.*                                                         experiment config -> typed configs

Config -> batches is m3_jax/data/inputs.py. Modules: trainer (orchestration in sections), state, checks, steps,
loop (what happens around each step), evaluation, checkpoint, metrics, optimizer, config_lib, defaults (every
config key), aot (--mode=aot: compile on a fake mesh)."""
