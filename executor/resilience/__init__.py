"""What keeps long runs alive on real clusters: restarts, integrity, preemption, one run per directory.

  lock.py       OUT/run.lock: one `execute` per run directory (flock, holder named, stale locks taken over)
  checkpoints.py the checkpoint directory as files: step-N, `latest`, what a resume tries, set-aside damage
  writer.py     DCP's FileSystemWriter that also leaves each file's sha256 (checksums.json)
  agree.py      rank 0 decides, every rank learns it; the non-finite check before any save
  timeouts.py   process groups' timeouts (long at start-up and saves, short per step), NCCL flight recorder
  agent.py      torchrun's elastic agent with a rendezvous generation key, one line per restart and no
                restart after a failure that would repeat (usage error, non-finite stop, preemption)
  integrity.py  a sha256 per checkpoint file, written with it by DCP's own writer and verified on load
                and by `meshplan checkpoint verify`
  contract.py   what a checkpoint's run was (seq_len, batch, steps): a resume that changes it is refused
                unless --allow-plan-change
  guard.py      non-finite loss or gradient norm: the update is skipped and counted; N in a row stop the run
  keeper.py     the training loop's side of all this: resume, stop agreement (Ctrl-C, SIGTERM), checkpoint
                cadence (sync or async_save), process-group timeouts, preemption's last checkpoint
No torch in lock, checkpoints, integrity, contract and guard: the launcher and `checkpoint verify` use them.
"""
