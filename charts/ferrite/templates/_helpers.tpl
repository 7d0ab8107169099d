{{/* Names and labels shared by every template. */}}

{{/* The release's full name, at most 63 characters. */}}
{{- define "ferrite.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator pods; never change them after install. */}}
{{- define "ferrite.selectorLabels" -}}
app.kubernetes.io/name: ferrite-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object the chart creates. */}}
{{- define "ferrite.labels" -}}
{{ include "ferrite.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: ferrite
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "ferrite.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferrite.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image reference. */}}
{{- define "ferrite.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{/* The engine image LLMServices get when they name none. */}}
{{- define "ferrite.engineImage" -}}
{{- default (printf "ghcr.io/ferrite-serving/ferrite-engine:%s" .Chart.AppVersion) .Values.engine.image -}}
{{- end -}}

{{/* Labels that select the router pods; never change them after install. */}}
{{- define "ferrite.routerSelectorLabels" -}}
app.kubernetes.io/name: ferrite-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on the router's objects. */}}
{{- define "ferrite.routerLabels" -}}
{{ include "ferrite.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/part-of: ferrite
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The router image reference. */}}
{{- define "ferrite.routerImage" -}}
{{- printf "%s:%s" .Values.router.image.repository (default .Chart.AppVersion .Values.router.image.tag) -}}
{{- end -}}
