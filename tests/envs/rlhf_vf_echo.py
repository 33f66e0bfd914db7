"""A one-turn verifiers 0.4 taskset for tests/envs' evaluation run against the rollout service: any reply is scored by
its length (the tiny random policy writes arbitrary text, so the test recomputes the reward from the trace)."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def length(self, trace: vf.Trace) -> float:
        return min(len(trace.last_reply), 50) / 50


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        yield EchoTask(EchoData(prompt="Say hello.", system_prompt="Be brief.", answer="hello"), self.config.task)
        yield EchoTask(EchoData(prompt="Count to three.", answer="1 2 3"), self.config.task)


__all__ = ["EchoTaskset"]
