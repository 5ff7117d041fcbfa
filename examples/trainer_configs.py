"""Print the settings that point SkyRL, prime-rl, AReaL or verl at a running ``prorsa serve``.

    prorsa serve --model /models/tiny --engines 3 --policy threshold --port 8000 &
    python examples/trainer_configs.py --url http://127.0.0.1:8000 --model tiny

Nothing is sent; see prorsa/integrations/README.md for what each trainer gets.
"""

from __future__ import annotations

import argparse

from prorsa.integrations.areal import areal_environment
from prorsa.integrations.prime_rl import prime_rl_toml
from prorsa.integrations.skyrl import skyrl_cli_overrides


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the prorsa server")
    parser.add_argument("--model", required=True, help="the name prorsa serves the model as")
    args = parser.parse_args(argv)
    sections = [
        "# SkyRL (command-line overrides)",
        " \\\n".join(skyrl_cli_overrides(args.url, args.model)),
        "",
        "# prime-rl (orchestrator config)",
        prime_rl_toml(args.url, args.model).rstrip(),
        "",
        "# AReaL (environment of the trainer process)",
        *(f"export {k}={v}" for k, v in areal_environment(args.url).items()),
        "",
        "# verl (overrides; its default V1 trainer in sync mode. Under trainer.use_v1=false:",
        "# prorsa.integrations.verl.ProrsaAgentLoopManager)",
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
        "prorsa.integrations.verl.ProrsaAgentLoopManagerTQ \\",
        f"+actor_rollout_ref.rollout.custom.prorsa_url={args.url} \\",
        "trainer.v1.trainer_mode=sync \\",
        "trainer.save_freq=1 \\",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    text = "\n".join(sections)
    print(text)
    return text


if __name__ == "__main__":
    main()
