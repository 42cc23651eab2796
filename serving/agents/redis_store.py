"""Redis agent-run store: run state shared by every gateway replica, one Lua script per operation.

Redis runs a script atomically, so each decision — a tool-call report, a model call's check, an
approval's decision — reads and writes every key it depends on with no other client in between:
fifty replicas reporting the same approved call get one permit between them. The scripts are the
memory store's code (:mod:`.memory`) written again in Lua, branch for branch; the same tests run
on both.

Keys (``prefix`` ``kva:`` by default; a run's keys share a base hashed from tenant and run id, so
no run id can collide with another run's keys)::

    {prefix}r:{sha256(tenant, run)[:32]}:st | :h | :n | :pr | :pa | :sx   stop, history, counts,
                                                                          prompt, pending, side effects
    {prefix}ik:{sha256(tenant, key)[:32]}     a tool call's idempotency key → "signature|permit id"
    {prefix}ab:{binding}                      approval binding → approval id
    {prefix}ap:{approval id}                  the approval (a hash)
    {prefix}pend:t:{tenant} / {prefix}pend:all  pending approvals by expiry (sorted sets)

The run's tool-call counter is the quota's own key (``kvq:r:{org}/RUN-ID:tc``, passed in), so the
quota store and this store must be the same Redis (``kvmeter serve`` opens both from one URL).
Deployment as for the quota: a single Redis (or a primary with replicas), not a Redis Cluster.

Errors: an unreachable Redis raises :class:`~.store.AgentStoreUnavailable` (fail closed).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .store import (APPROVAL_RETENTION_S, IDEMPOTENCY_KEY_TTL_S, RUN_STATE_TTL_S, AgentStore,
                    AgentStoreUnavailable, Approval, DecideResult, ModelCallResult, ReportRequest,
                    ReportResult, RunStop)
from .loops import signature

__all__ = ["RedisAgentStore", "REPORT_LUA", "MODEL_CALL_LUA", "DECIDE_LUA"]

_PRELUDE = r"""
local function fmt(x) return string.format('%.17g', x) end
local function hash(key)
  local r = redis.call('HGETALL', key)
  local t = {}
  for i = 1, #r, 2 do t[r[i]] = r[i + 1] end
  return t
end
local STOP = {'reason', 'tool', 'period', 'limit', 'ts'}
local function flat(t)
  local out = {}
  if t then for k, v in pairs(t) do out[#out + 1] = k; out[#out + 1] = v end end
  return out
end
"""

#: KEYS: 1 stop, 2 history, 3 counts, 4 prompt, 5 pending (run), 6 side effects, 7 idempotency key,
#: 8 approval binding, 9 pending (tenant), 10 pending (all), 11 the quota's tool-call counter.
#: ARGV: see RedisAgentStore.report. Returns {outcome, tool_call_id, created, tool_calls, mismatch,
#: stop reason, tool, period, limit, ts, approval field, value, ...}.
REPORT_LUA = _PRELUDE + r"""
local now = tonumber(ARGV[1])
local risk, sig, tool, digest, pv = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local has_key = ARGV[7] == '1'
local hint, new_tc, new_ap = ARGV[8], ARGV[9], ARGV[10]
local tenant, ws, proj, akey, run = ARGV[11], ARGV[12], ARGV[13], ARGV[14], ARGV[15]
local ttl, window = tonumber(ARGV[16]), tonumber(ARGV[17])
local max_tc, max_ident, max_rep = ARGV[18], ARGV[19], ARGV[20]
local max_len, hist_len = tonumber(ARGV[21]), tonumber(ARGV[22])
local run_ttl = tonumber(ARGV[23])
local ap_prefix = ARGV[24]
local idem_ttl, retention = tonumber(ARGV[25]), tonumber(ARGV[26])
local loop_on = ARGV[27] == '1'
local run_base = ARGV[28]
local decide_only = ARGV[29] == '1'

local function result(outcome, tc_id, created, total, mismatch, stop, ap)
  local out = {outcome, tc_id or '', created and '1' or '0', total and tostring(total) or '', mismatch or ''}
  for _, f in ipairs(STOP) do out[#out + 1] = (stop and stop[f]) or '' end
  for _, v in ipairs(flat(ap)) do out[#out + 1] = v end
  return out
end
local function stop_run(reason, period, limit)
  local st = {reason = reason, tool = tool, period = tostring(period), limit = limit, ts = fmt(now)}
  redis.call('HSET', KEYS[1], 'reason', st.reason, 'tool', st.tool, 'period', st.period, 'limit', st.limit,
             'ts', st.ts)
  redis.call('EXPIRE', KEYS[1], run_ttl)
  return result('loop_stopped', nil, false, nil, nil, st)
end

-- 1. replay of a call already permitted
if decide_only then
  -- a call the model emitted: no permit is given here, so nothing to replay
elseif has_key then
  local rec = redis.call('GET', KEYS[7])
  if rec then
    local s, id = string.match(rec, '^(.*)|([^|]*)$')
    if s ~= sig then return result('idempotency_conflict', id) end
    return result('replayed', id)
  end
elseif risk == 'side_effect' then
  local rec = redis.call('HGET', KEYS[6], sig)
  if rec then
    local id, untl = string.match(rec, '^([^|]*)|(.*)$')
    if tonumber(untl) > now then return result('replayed', id) end
  end
end
-- 2. a stopped run
local st = hash(KEYS[1])
if st.reason then return result('run_stopped', nil, false, nil, nil, st) end
-- 3. approval
local ap, apkey = nil, nil
if risk == 'high_risk' then
  if hint ~= '' then
    apkey = ap_prefix .. hint
    ap = hash(apkey)
    if not ap.approval_id then return result('approval_not_found') end
    local mm = ''
    if ap.tenant_id ~= tenant then mm = 'tenant'
    elseif ap.run_id ~= run then mm = 'agent_run_id'
    elseif ap.api_key_id ~= akey then mm = 'api_key'
    elseif ap.tool ~= tool then mm = 'tool'
    elseif ap.arguments_sha256 ~= digest then mm = 'arguments'
    elseif ap.policy_version ~= pv then mm = 'policy_version' end
    if mm ~= '' then return result('approval_mismatch', nil, false, nil, mm, nil, ap) end
  else
    local aid = redis.call('GET', KEYS[8])
    if aid then
      apkey = ap_prefix .. aid
      ap = hash(apkey)
      if not ap.approval_id then ap = nil end
    end
  end
  local status = 'none'
  if ap then
    status = ap.state
    if (status == 'pending' or status == 'approved') and now >= tonumber(ap.expires_ts) then status = 'expired' end
  end
  if status == 'pending' then return result('pending_approval', nil, false, nil, nil, nil, ap) end
  if status == 'rejected' and now < tonumber(ap.expires_ts) then
    return result('approval_rejected', nil, false, nil, nil, nil, ap)
  end
  if hint ~= '' and (status == 'consumed' or status == 'expired' or status == 'rejected') then
    local o = 'approval_expired'
    if status == 'consumed' then o = 'approval_used' end
    return result(o, ap.tool_call_id, false, nil, nil, nil, ap)
  end
  if status ~= 'approved' then
    local expires = now + ttl
    local nk = ap_prefix .. new_ap
    local keep = math.ceil(ttl + retention)
    redis.call('HSET', nk, 'approval_id', new_ap, 'tenant_id', tenant, 'workspace_id', ws,
               'project_id', proj, 'api_key_id', akey, 'run_id', run, 'tool', tool, 'risk_class', risk,
               'arguments_sha256', digest, 'policy_version', pv, 'created_ts', fmt(now),
               'expires_ts', fmt(expires), 'state', 'pending', 'decided_by', '', 'decided_ts', '0',
               'reason', '', 'tool_call_id', '', 'run_base', run_base)
    redis.call('EXPIRE', nk, keep)
    redis.call('SET', KEYS[8], new_ap, 'EX', keep)
    redis.call('ZADD', KEYS[5], fmt(expires), new_ap)
    redis.call('EXPIRE', KEYS[5], run_ttl)
    redis.call('ZADD', KEYS[9], fmt(expires), new_ap)
    redis.call('ZADD', KEYS[10], fmt(expires), new_ap)
    return result('pending_approval', nil, true, nil, nil, nil, hash(nk))
  end
end
if decide_only then
  if risk == 'high_risk' then return result('approval_granted', nil, false, nil, nil, nil, ap) end
  return result('allowed')
end
-- 4. loop stops
if loop_on then
  local n = tonumber(redis.call('HGET', KEYS[3], sig) or '0') + 1
  if max_ident ~= '' and n > tonumber(max_ident) then return stop_run('identical_tool_calls', 0, max_ident) end
  if max_rep ~= '' then
    local h = redis.call('LRANGE', KEYS[2], 0, hist_len - 2)
    table.insert(h, 1, sig)
    local best, bp = 0, 0
    for p = 2, max_len do
      if #h > p then
        local distinct = false
        for i = 2, p do
          if h[i] ~= h[1] then distinct = true; break end
        end
        if distinct then
          local r = 0
          while r + p < #h and h[r + 1] == h[r + p + 1] do r = r + 1 end
          if r > best then best, bp = r, p end
        end
      end
    end
    if best > tonumber(max_rep) then return stop_run('tool_cycle', bp, max_rep) end
  end
end
-- 5. budget: the quota's counter of the run's tool calls
local total = redis.call('INCR', KEYS[11])
redis.call('EXPIRE', KEYS[11], run_ttl)
if max_tc ~= '' and total > tonumber(max_tc) then return result('budget_exceeded', nil, false, total) end
-- 6. permit
if loop_on and hist_len > 0 then
  redis.call('LPUSH', KEYS[2], sig)
  redis.call('LTRIM', KEYS[2], 0, hist_len - 1)
  redis.call('EXPIRE', KEYS[2], run_ttl)
end
redis.call('HINCRBY', KEYS[3], sig, 1)
redis.call('EXPIRE', KEYS[3], run_ttl)
redis.call('DEL', KEYS[4])
if ap then redis.call('HSET', apkey, 'state', 'consumed', 'tool_call_id', new_tc) end
if has_key then
  redis.call('SET', KEYS[7], sig .. '|' .. new_tc, 'EX', idem_ttl)
elseif risk == 'side_effect' then
  redis.call('HSET', KEYS[6], sig, new_tc .. '|' .. fmt(now + window))
  redis.call('EXPIRE', KEYS[6], run_ttl)
end
if ap then ap = hash(apkey) end
return result('allowed', new_tc, false, total, nil, nil, ap)
"""

#: KEYS: 1 stop, 2 pending (run), 3 prompt. ARGV: now, prompt digest ('' none), max repeated
#: prompts ('' none), run TTL s. Returns {outcome, approval id, repeats, stop fields...}.
MODEL_CALL_LUA = _PRELUDE + r"""
local now, digest, mx, run_ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local function answer(outcome, aid, repeats, st)
  local out = {outcome, aid or '', tostring(repeats or 0)}
  for _, f in ipairs(STOP) do out[#out + 1] = (st and st[f]) or '' end
  return out
end
local st = hash(KEYS[1])
if st.reason then return answer('run_stopped', nil, 0, st) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(now))
local first = redis.call('ZRANGE', KEYS[2], 0, 0)
if #first > 0 then return answer('approval_pending', first[1], 0) end
if digest == '' then return answer('ok', nil, 0) end
local pr = hash(KEYS[3])
local c = 1
if pr.d == digest then c = tonumber(pr.c) + 1 end
if mx ~= '' and c > tonumber(mx) then
  st = {reason = 'repeated_prompt', tool = '', period = '0', limit = mx, ts = fmt(now)}
  redis.call('HSET', KEYS[1], 'reason', st.reason, 'tool', '', 'period', '0', 'limit', mx, 'ts', st.ts)
  redis.call('EXPIRE', KEYS[1], run_ttl)
  return answer('loop_stopped', nil, c, st)
end
redis.call('HSET', KEYS[3], 'd', digest, 'c', c)
redis.call('EXPIRE', KEYS[3], run_ttl)
return answer('ok', nil, c)
"""

#: KEYS: 1 the approval. ARGV: now, '1' approve / '0' reject, deciding key id, reason,
#: tenant pending-set prefix, all-pending set. Returns {outcome, approval field, value, ...}.
DECIDE_LUA = _PRELUDE + r"""
local now = tonumber(ARGV[1])
local a = hash(KEYS[1])
if not a.approval_id then return {'not_found'} end
local function answer(outcome, t)
  local out = {outcome}
  for _, v in ipairs(flat(t)) do out[#out + 1] = v end
  return out
end
if a.state ~= 'pending' then return answer('already_decided', a) end
if now >= tonumber(a.expires_ts) then return answer('expired', a) end
local state = 'rejected'
if ARGV[2] == '1' then state = 'approved' end
redis.call('HSET', KEYS[1], 'state', state, 'decided_by', ARGV[3], 'decided_ts', fmt(now), 'reason', ARGV[4])
redis.call('ZREM', a.run_base .. 'pa', a.approval_id)
redis.call('ZREM', ARGV[5] .. a.tenant_id, a.approval_id)
redis.call('ZREM', ARGV[6], a.approval_id)
return answer(state, hash(KEYS[1]))
"""

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def _s(v: Any) -> str:
    return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)


def _pairs(items: Sequence[Any]) -> dict[str, str]:
    return {_s(items[i]): _s(items[i + 1]) for i in range(0, len(items) - 1, 2)}


def _stop(fields: Sequence[Any]) -> RunStop | None:
    reason, tool, period, limit, ts = (_s(v) for v in fields)
    if not reason:
        return None
    return RunStop(reason, tool, int(period or 0), int(limit or 0), float(ts or 0))


def _approval(raw: dict[str, str]) -> Approval | None:
    return Approval.from_fields(raw) if raw.get("approval_id") else None


def _opt(v: int | None) -> str:
    return "" if v is None else str(int(v))


class RedisAgentStore(AgentStore):
    """Agent-run state in Redis (see module docstring).

    Args:
        client: a ``redis.asyncio.Redis`` (``decode_responses=False``), best made with
            :func:`kvmeter.serving.quota.redis_client` (short timeouts) on the quota's URL.
        key_prefix: namespace of this store's keys (the quota's counter keys keep theirs).
    """

    name = "redis"

    def __init__(self, client: aioredis.Redis, *, key_prefix: str = "kva:") -> None:
        self._client = client
        self.key_prefix = key_prefix
        self._report = client.register_script(REPORT_LUA)
        self._model_call = client.register_script(MODEL_CALL_LUA)
        self._decide = client.register_script(DECIDE_LUA)

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    def _run_base(self, tenant_id: str, run_id: str) -> str:
        h = hashlib.sha256(f"{tenant_id}\x1f{run_id}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{self.key_prefix}r:{h}:"

    async def _call(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except _UNREACHABLE as e:
            raise AgentStoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e

    async def report(self, req: ReportRequest) -> ReportResult:
        p = self.key_prefix
        base = self._run_base(req.tenant_id, req.run_id)
        key = req.idempotency_key if req.risk_class != "read_only" else ""
        ik = hashlib.sha256(f"{req.tenant_id}\x1f{key}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
        loop = req.loop_stops
        keys = [base + "st", base + "h", base + "n", base + "pr", base + "pa", base + "sx", f"{p}ik:{ik}",
                f"{p}ab:{req.binding}", f"{p}pend:t:{req.tenant_id}", f"{p}pend:all", req.tool_calls_key]
        args = [repr(float(req.now)), req.risk_class, signature(req.tool, req.arguments_sha256), req.tool,
                req.arguments_sha256, req.policy_version, "1" if key else "0", req.approval_id,
                req.new_tool_call_id, req.new_approval_id, req.tenant_id, req.workspace_id,
                req.project_id, req.api_key_id, req.run_id, repr(float(req.approval_ttl_s)),
                repr(float(req.side_effect_window_s)), _opt(req.max_tool_calls),
                _opt(loop.max_identical_tool_calls if loop else None), _opt(loop.max_cycle_repeats if loop else None),
                loop.max_cycle_length if loop else 2, loop.history_calls if loop else 0, RUN_STATE_TTL_S,
                f"{p}ap:", IDEMPOTENCY_KEY_TTL_S, APPROVAL_RETENTION_S, "1" if loop else "0", base,
                "1" if req.decide_only else "0"]
        res = await self._call(self._report, keys, args)
        outcome, tc_id, created, total, mismatch = (_s(v) for v in res[:5])
        return ReportResult(outcome, tool_call_id=tc_id, approval=_approval(_pairs(res[10:])),
                            approval_created=created == "1", tool_calls=int(total) if total else None,
                            stop=_stop(res[5:10]), stopped_now=outcome == "loop_stopped", mismatch=mismatch)

    async def model_call(self, tenant_id: str, run_id: str, prompt_digest: str, max_repeated_prompts: int | None,
                         now: float) -> ModelCallResult:
        base = self._run_base(tenant_id, run_id)
        res = await self._call(self._model_call, [base + "st", base + "pa", base + "pr"],
                               [repr(float(now)), prompt_digest, _opt(max_repeated_prompts), RUN_STATE_TTL_S])
        outcome, aid, repeats = (_s(v) for v in res[:3])
        return ModelCallResult(outcome, stop=_stop(res[3:8]), stopped_now=outcome == "loop_stopped",
                               approval_id=aid, repeats=int(repeats))

    async def decide(self, approval_id: str, approve: bool, actor_key_id: str, reason: str,
                     now: float) -> DecideResult:
        p = self.key_prefix
        res = await self._call(self._decide, [f"{p}ap:{approval_id}"],
                               [repr(float(now)), "1" if approve else "0", actor_key_id, reason, f"{p}pend:t:",
                                f"{p}pend:all"])
        return DecideResult(_s(res[0]), _approval(_pairs(res[1:])))

    async def get_approval(self, approval_id: str) -> Approval | None:
        try:
            raw = await self._client.hgetall(f"{self.key_prefix}ap:{approval_id}")
        except _UNREACHABLE as e:
            raise AgentStoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e
        return _approval({_s(k): _s(v) for k, v in raw.items()})

    async def list_pending(self, tenant_id: str | None, now: float, limit: int) -> list[Approval]:
        p = self.key_prefix
        zkey = f"{p}pend:t:{tenant_id}" if tenant_id is not None else f"{p}pend:all"
        try:
            await self._client.zremrangebyscore(zkey, "-inf", repr(float(now)))
            ids = await self._client.zrangebyscore(zkey, f"({float(now)!r}", "+inf", start=0, num=limit)
            async with self._client.pipeline(transaction=False) as pipe:
                for aid in ids:
                    pipe.hgetall(f"{p}ap:{_s(aid)}")
                rows = await pipe.execute()
        except _UNREACHABLE as e:
            raise AgentStoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e
        found = [_approval({_s(k): _s(v) for k, v in raw.items()}) for raw in rows]
        return [a for a in found if a is not None and a.state == "pending" and a.expires_ts > now]

    async def run_stop(self, tenant_id: str, run_id: str) -> RunStop | None:
        try:
            raw = await self._client.hgetall(self._run_base(tenant_id, run_id) + "st")
        except _UNREACHABLE as e:
            raise AgentStoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e
        d = {_s(k): _s(v) for k, v in raw.items()}
        return _stop([d.get(f, "") for f in ("reason", "tool", "period", "limit", "ts")]) if d else None

    async def aclose(self) -> None:
        await self._client.aclose()
