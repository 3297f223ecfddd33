"""DeepResearch-style multi-agent workload: config, plan generator, client, runner, report.

A research session is one lead agent and 2-6 sub-agents, each in its own
server-side session. The lead plans (turn 0) and its plan is parsed into one
sub-question per sub-agent; each sub-agent writes a search query, reads 1-3 of
the BM25 hits (tool pauses before each), and answers a graded fact question cut
from its target article; the lead then reads the findings (quotes, answers) and
writes the report (turn 1). A run's trace replays it exactly.

Module map:

- ``config``       TenantProfile, ToolPauseConfig, CallMaxTokens, WorkloadConfig
- ``demo_config``  demo_tenants(), demo_config(): 4 tenants, one noisy at 4x
- ``sampling``     Gamma arrivals, heavy-tailed tool pauses, Zipf popularity
- ``prompts``      the text of every prompt
- ``plan``         PlannedCall / SubagentTask / AgentScript / ResearchSession / WorkloadPlan
- ``generator``    generate_plan(config) -> WorkloadPlan (deterministic under the seed)
- ``parsing``      parse_plan, clean_query, names_title: reading the model's replies
- ``agents``       ResearchAgents (turns written from the model's replies), ReplayTurns
- ``trace``        trace.jsonl: write_trace, load_replay(path) -> WorkloadPlan
- ``client``       CallResult, the InferenceClient protocol, StatsProbe
- ``grpc_client``  GrpcInferenceClient (kvstrata.v1 over grpc.aio)
- ``stats_probe``  grpc_stats_probe(channel, admin_key): AdminService.Stats samples
- ``records``      one calls.jsonl row per planned call; agent_counts (fallbacks, targets found)
- ``runner``       run_workload(plan, client, api_keys, options=RunOptions(...))
- ``floor``        token-rate floor attainment from records
- ``metrics``      compute_report(records, timeseries, tenants) (pure), exit_code
- ``plots``        TTFT CDF, memory/occupancy over time, throughput (PNG)
- ``summary``      report.md text and the rich summary table
- ``report``       write_report(...): reports/deepresearch/<timestamp>/ + reports/latest
- ``job``          run_deepresearch / run_deepresearch_grpc: all of the above, one call
"""
