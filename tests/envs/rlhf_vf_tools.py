"""A verifiers 0.4 taskset with a tool (an MCP toolset) for tests/envs: add two numbers with ``calc_add``, then answer.
No Env of its own: verifiers runs it as SingleAgentEnv (one segment, the harness's tool loop)."""

import verifiers.v1 as vf


class CalcState(vf.State):
    additions: int = 0


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig, CalcState]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        self.state.additions += 1  # the rollout's state, shared with the task's hooks
        return a + b


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData, CalcState]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))

    @vf.metric
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @vf.metric
    async def additions(self, trace: vf.Trace) -> float:
        return float(trace.state.additions)


class SumConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    @classmethod
    def toolsets(cls, config: SumConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    def load(self):
        return [SumTask(SumData(prompt="What is 1234 + 4321? Use the tool.", answer=5555), self.config.task)]


__all__ = ["SumTaskset"]
