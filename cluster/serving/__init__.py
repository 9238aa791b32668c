"""The serving path: from a spec to running pools of workers, and a request's life across them.

Life of a request (disaggregated; docs/design.md "Life of a request"), module by module:

    ray_pools.start_cluster(spec)     Ray (ray_session.init_ray), placement groups, one actors.WorkerActor per
                                      replica slot (its worker on a worker_loop.WorkerLoop thread, with a
                                      step watchdog), actors.RayHandles -> the router, RayPools its spawner
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
    a worker lost (killed, crashed, a drain or call failed, no heartbeat, a step past the watchdog's bound):
      recovery.Recovery.lose            membership fences it; the flights it harmed are re-queued under a
                                        new wid and resume where their stream stopped (recovery.recover)
      recovery.Recovery._heal           its slot gets a worker again (Ray's restart, else a fresh actor from
                                        the spawner, with backoff on crash loops: membership.replace);
                                        meanwhile requests needing the pool wait (bounded by their deadline)
                                        and /health, /metrics say the pool is degraded, why, since when
    a resize (`pdserve scale`, POST /v1/pdserve/admin/scale -> router.ClusterRouter.scale):
      scaling.Scaler.scale              checks (typed 400s); grows: spawner.add, join, poller; shrinks: the
                                        newest members drain, finish or hand off what they hold, leave,
                                        and the spawner removes them
    the SLO autoscaler (`autoscaling.enabled`; ray_pools.attach_autoscaler gives the router one):
      autoscaler.RequestLog             the router notes each request's arrival and end (TTFT, TPOT)
      autoscaler.Autoscaler.tick        every interval: the window -> autoscale_policy.Policy.step (rate and
                                        mix, correction factor, autoscale_capacity.PlannerCapacity: the
                                        planner's model and simulator) -> request_resources (multi-node Ray)
                                        -> router.ClusterRouter.scale, the resize path above
Colocated: admission's `add_request` on the replica with the least load; every event is a decode delta.

Who owns what:
    membership   PoolMembership: one per pool, the live set (join, drain, leave, replace, fence) that
                 admission, recovery and the autoscaler read and change; its health; Worker: one
                 member's record; Spawner: the protocol of what starts workers
    router       ClusterRouter, RouterConfig: owns the collaborators below and the request's own life
    admission    Admission: the FIFO and placement            recovery  Recovery, Ledger: the workers' side
    holdings     Holdings: what workers hold for a flight      flight    Flight, FlightTable, Inbox
    tasks        Tasks: what runs beside the callers           intake    request checks
    scaling      Scaler, ScaleError: live resizing of a pool
    autoscaler   Autoscaler, RequestLog: the SLO autoscaler's loop     autoscale_policy  Policy: its decisions
    autoscale_capacity  PlannerCapacity: replicas per pool from the planner's latency model and simulator
    autoscale_evidence  LoadBands, Demonstrated: the correction per load band, the rate a replica carried
    prefix_routing  PrefixIndex, PrefixPlacer: KV-aware choices
    worker_loop  WorkerLoop (a worker's step loop on a thread, its step watchdog), LocalHandle and
                 LocalPools (in-process workers and their spawner)
    actors       WorkerActor (test hooks: slow_steps, hang_steps, rss_bytes), RayHandle (Ray itself:
                 cluster/ray_session.py)
    ray_pools    RayPools (placement, start, replace, close: the Ray spawner), start_cluster, router_config,
                 step_bound (the watchdog's bound from the spec or the model's latency profile)
    placement    a pool's bundles and placement groups on nodes of its accelerator type, the bounded wait
                 for them (`reliability.placement_timeout_s`), PlacementError

Import arrows (one direction; tests/unit/test_imports.py checks them): ray_pools -> router, actors, placement;
router -> admission, scaling -> recovery -> holdings -> flight, membership, tasks; actors -> worker_loop;
router -> autoscaler -> autoscale_capacity -> autoscale_policy -> autoscale_evidence; ray_pools -> autoscaler.
Only actors, placement and ray_pools import ray, the router imports none of them, and outside this room only
the launcher (`cluster/launch.py`) imports them. This package's `__init__` imports nothing.
"""
