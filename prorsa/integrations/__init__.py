"""prorsa inside existing RL trainers: configuration and adapters, one module per trainer.

* :mod:`.skyrl` and :mod:`.prime_rl`: configuration only — both talk HTTP to one proxy URL
  and fan control calls out to a list of servers; ``prorsa serve`` is both.
* :mod:`.areal`: AReaL's ``RemoteInfEngine`` takes server addresses.
* :mod:`.verl`: an ``agent_loop_manager_class`` whose LLM client sends verl's requests to
  prorsa (verl keeps its own weight sync).

See ``prorsa/integrations/README.md`` for what each covers, what does not, and why.
"""
