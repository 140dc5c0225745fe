{{/* Chart name, truncated to the 63 characters Kubernetes names allow. */}}
{{- define "stepscope.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name, unless the release name already contains the chart name. */}}
{{- define "stepscope.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stepscope.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stepscope.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepscope.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stepscope.labels" -}}
helm.sh/chart: {{ include "stepscope.chart" . }}
{{ include "stepscope.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: exporter
app.kubernetes.io/part-of: stepscope
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "stepscope.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stepscope.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "stepscope.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the ingest token: the user's, or the one this chart generates. */}}
{{- define "stepscope.ingestSecretName" -}}
{{- default (printf "%s-ingest" (include "stepscope.fullname" .)) .Values.ingest.token.existingSecret }}
{{- end }}

{{- define "stepscope.ingestSecretKey" -}}
{{- .Values.ingest.token.key }}
{{- end }}

{{- define "stepscope.ingestTokenDir" -}}
/etc/stepscope/ingest
{{- end }}

{{/*
"true" when a Prometheus Operator object should render: `auto` follows the cluster's API
(monitoring.coreos.com/v1), true/false are obeyed as given. Called with (list setting $).
*/}}
{{- define "stepscope.operatorObjectEnabled" -}}
{{- $setting := toString (index . 0) }}
{{- $root := index . 1 }}
{{- if eq $setting "auto" }}
{{- if $root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- else if eq $setting "true" }}true
{{- end }}
{{- end }}

{{- define "stepscope.podMonitorEnabled" -}}
{{- include "stepscope.operatorObjectEnabled" (list .Values.podMonitor.enabled .) }}
{{- end }}

{{- define "stepscope.serviceMonitorEnabled" -}}
{{- $setting := toString .Values.serviceMonitor.enabled }}
{{- if and (eq $setting "true") (include "stepscope.podMonitorEnabled" .) }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled are both true: choose one, or every target is scraped twice" }}
{{- end }}
{{- if not (and (eq $setting "auto") (include "stepscope.podMonitorEnabled" .)) }}
{{- include "stepscope.operatorObjectEnabled" (list .Values.serviceMonitor.enabled .) }}
{{- end }}
{{- end }}

{{- define "stepscope.prometheusRuleEnabled" -}}
{{- include "stepscope.operatorObjectEnabled" (list .Values.prometheusRule.enabled .) }}
{{- end }}

{{/* Scrape relabeling shared by the ServiceMonitor and the PodMonitor: the node is the instance. */}}
{{- define "stepscope.relabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: instance
  action: replace
{{- with .relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}
