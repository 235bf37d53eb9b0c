{{/* The name of every object: fixed, like the kustomize base (Leases and ClusterRoles are cluster-wide anyway). */}}
{{- define "gpu-health-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object: the kustomize base's two, then Helm's own. */}}
{{- define "gpu-health-agent.labels" -}}
app.kubernetes.io/name: {{ include "gpu-health-agent.name" . }}
app.kubernetes.io/part-of: gpu-health-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpu-health-agent.selector" -}}
app.kubernetes.io/name: {{ include "gpu-health-agent.name" . }}
{{- end -}}

{{/* The agent's configuration file, built from the values. */}}
{{- define "gpu-health-agent.config" -}}
{{- $config := dict
  "mode" .Values.mode
  "dry_run" .Values.dryRun
  "rules_dir" "/etc/gpu-health-agent/rules"
  "journal_path" "/var/lib/gpu-health-agent/journal.db"
  "sources" .Values.sources
  "remediation" (dict
    "taint_key" .Values.remediation.taintKey
    "taint_effect" .Values.remediation.taintEffect
    "opt_out_label" .Values.remediation.optOutLabel
    "replace_after_recoveries" .Values.remediation.replaceAfterRecoveries
    "recovery_window_days" .Values.remediation.recoveryWindowDays
    "reset_verify_seconds" .Values.remediation.resetVerifySeconds
    "reset_helper_socket" "/run/gpu-health-agent/reset.sock"
    "diagnostic_command" .Values.remediation.diagnosticCommand
    "diagnostic_timeout_seconds" .Values.remediation.diagnosticTimeoutSeconds
    "budget_max_nodes" .Values.budget.maxNodes
    "budget_max_percent" .Values.budget.maxPercent
    "budget_max_nodes_per_hour" .Values.budget.maxNodesPerHour
    "gpu_node_selector" .Values.gpuNodeSelector
    "isolation" .Values.isolation
    "device_taint_effect" .Values.dra.taintEffect
    "device_taint_degraded" .Values.dra.taintDegraded
    "fleet_holds" .Values.fleet.holds
    "brake_max_share" .Values.brake.maxShare
    "brake_min_nodes" .Values.brake.minNodes
    "brake_max_nodes" .Values.brake.maxNodes
    "brake_window_seconds" .Values.brake.windowSeconds
    "namespace" .Release.Namespace)
  "http" (dict "port" .Values.metricsPort)
  "log" .Values.log -}}
{{- toYaml (mergeOverwrite $config (deepCopy .Values.extraConfig)) -}}
{{- end -}}

{{/*
Renders a manifest file of the kustomize base copied under files/ (scripts/sync-deploy-rules keeps the copy
current; the drift test fails when it is not): every document gets the chart's labels, the release namespace
where it had one, and the release's service-account name wherever the base names gpu-health:gpu-health-agent, and the
chart's name (nameOverride) for gpu-health-agent in object names.
*/}}
{{- define "gpu-health-agent.fromBase" -}}
{{- $root := index . 0 -}}
{{- $file := index . 1 -}}
{{- $name := include "gpu-health-agent.name" $root -}}
{{- $account := printf "system:serviceaccount:%s:%s" $root.Release.Namespace $name -}}
{{- $text := $root.Files.Get $file | replace "system:serviceaccount:gpu-health:gpu-health-agent" $account -}}
{{- /* With nameOverride the objects are renamed too (two releases side by side); label keys stay. */ -}}
{{- $text = $text | replace "gpu-health-agent.io/" "\x00LABELKEY\x00" | replace "gpu-health-agent" $name | replace "\x00LABELKEY\x00" "gpu-health-agent.io/" -}}
{{- range $document := regexSplit "(?m)^---\\s*$" $text -1 }}
{{- $object := fromYaml $document }}
{{- if $object }}
{{- $meta := $object.metadata }}
{{- $_ := set $meta "labels" (mergeOverwrite (default dict $meta.labels) (include "gpu-health-agent.labels" $root | fromYaml)) }}
{{- if hasKey $meta "namespace" }}{{ $_ := set $meta "namespace" $root.Release.Namespace }}{{ end }}
{{- range $subject := default list $object.subjects }}
{{- if eq $subject.kind "ServiceAccount" }}{{ $_ := set $subject "namespace" $root.Release.Namespace }}{{ end }}
{{- end }}
---
{{ toYaml $object }}
{{- end }}
{{- end }}
{{- end -}}
