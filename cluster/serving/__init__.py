"""The serving path: from a spec to running pools of workers, and a request's life across them.

Life of a request (disaggregated; DESIGN.md "Life of a request"), module by module:

    actors.start_cluster(spec)        Ray: placement groups, one WorkerActor per replica (each runs its
                                      worker on a worker_loop.WorkerLoop thread), RayHandles -> the router
    router.ClusterRouter.generate     the ServingBackend the HTTP frontend and client call
      intake.validate_request           typed 400s, a fixed seed; queue limit (429)
      flight.Flight / FlightTable       the request's record; joins the FIFO
      admission.Admission.run/place     decode worker (pages, load; prefix_routing.PrefixPlacer orders by
                                        cached prefix) -> `reserve`; prefill worker -> `submit` beside the
                                        loop, after a KV receive stream (holdings.Holdings)
      recovery.Recovery.poll            one long-poll per worker: events -> their flight's Inbox (heartbeat)
      router._apply / flight.advance    events -> GenerateDeltas: first token (TTFT), decode deltas, the end
      router._end -> holdings.release   exactly once: completed / failed / cancelled (recovery.Ledger);
                                        abort/cancel whatever workers still hold
    a worker lost (drain or call failed, no heartbeat, no answer):
      recovery.Recovery.lose            membership fences it; the flights it harmed are re-queued under a
                                        new wid and resume where their stream stopped (recovery.recover);
                                        a restarted actor replaces it (membership.replace)
Colocated: admission's `add_request` on the replica with the least load; every event is a decode delta.

Who owns what:
    membership   PoolMembership: one per pool, the live set (join, drain, leave, replace, fence) that
                 admission, recovery and (later) the autoscaler read and change; Worker: one member's record
    router       ClusterRouter, RouterConfig: owns the collaborators below and the request's own life
    admission    Admission: the FIFO and placement            recovery  Recovery, Ledger: workers' side
    holdings     Holdings: what workers hold for a flight      flight    Flight, FlightTable, Inbox
    tasks        Tasks: what runs beside the callers           intake    request checks
    prefix_routing  PrefixIndex, PrefixPlacer: KV-aware choices
    worker_loop  WorkerLoop (a worker's step loop on a thread), LocalHandle (in-process workers)
    actors       WorkerActor, RayHandle, start_cluster: the only module here that imports ray

Import arrows (one direction; tests/unit/test_imports.py checks them): actors -> router -> admission ->
recovery -> holdings -> flight, membership, tasks; worker_loop and prefix_routing import none of them.
Nothing here imports actors except the launcher (`cluster/launch.py`). This package's `__init__` imports
nothing, so importing one module does not pull in the others.
"""
