"""DeepResearch-style multi-agent workload: config, plan generator, client, runner, report.

A research session is one lead agent and 2-6 sub-agents, each in its own
server-side session. The lead plans (turn 0); each sub-agent searches (tool
pause), reads 1-3 shared articles, and answers a fact question cut from what it
read; the lead then reads the findings and writes the report (turn 1).
"""
